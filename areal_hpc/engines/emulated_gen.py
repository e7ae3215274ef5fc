"""Emulated generation: continuous batching whose steps take the cost model's time; tokens are placeholders.

For planning and for running the real runtime at cluster shape on one machine: no weights and no forward
pass. Each request's response length is drawn from a long-tailed distribution, fixed by its id, so an
interrupted request resumes towards the same length (and pays a prefill of prompt + partial, as vLLM does).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Hashable
from pathlib import Path

import numpy as np
import torch

from areal_hpc.costmodel import ResponseLengths, RunSettings, emulated_cost
from areal_hpc.engines.base import GenerationEngine, InFlight
from areal_hpc.model import stop_token_ids
from areal_hpc.types import GenOutput, GenRequest


def _vocab(model_path: str) -> int:
    """Placeholder tokens come from the model folder's vocabulary (so the tokenizer decodes them)."""
    return int(json.loads((Path(model_path) / "config.json").read_text()).get("vocab_size", 32000))


def payload(mb: float) -> dict[str, torch.Tensor]:
    """What is broadcast per version: `mb` of real bytes; the cost model's sync_s stands for the model's size."""
    return {"emulated.payload": torch.zeros(max(1, int(mb * 2**20 / 4)), dtype=torch.float32)}


class EmulatedGenerationEngine(GenerationEngine):
    """The step-driven interface with the cost model's step times (scaled by `time_scale`).

    A step admits waiting requests into free slots (their prompt + partial is prefilled), then every
    running sequence gets one placeholder token. A step ends `dt` after it was called; the caller's work
    between steps adds to it, as a GPU node's host overhead does (so a slow host shows in the figures).
    """

    def __init__(
        self,
        model_path: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        max_num_seqs: int = 256,
        preset_name: str = "1.5B",
        cost_overrides: dict | None = None,
        time_scale: float = 1.0,
        len_median: float = 0.0,
        len_sigma: float = 1.0,
        payload_mb: float = 1.0,
        run: RunSettings | None = None,
    ):
        super().__init__(max_num_seqs, temperature, top_p)
        self.cost = emulated_cost(preset_name, cost_overrides, run)  # run: LoRA's sync_s moves the adapter alone
        self.time_scale = time_scale
        self.len_median, self.len_sigma = len_median, len_sigma
        self.seed = seed
        self.vocab = _vocab(model_path)
        # an answer ends with the folder's first stop token; placeholders never hit one before the target
        self.stop_ids = stop_token_ids(model_path)
        self.eos = self.stop_ids[0]
        self._not_stop = np.setdiff1d(np.arange(self.vocab), self.stop_ids)
        self.rng = np.random.default_rng(seed)
        self._weights = payload(payload_mb)
        self.running: list[InFlight] = []
        self.waiting: deque[InFlight] = deque()
        self.target: dict[Hashable, int] = {}  # request id -> the response length it stops at (eos)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, requests: list[GenRequest]) -> None:
        for r in requests:
            seq = self._admit(r)
            if seq is None:
                continue
            median = self.len_median or r.max_new_tokens / 4
            # the request id, not the partial, fixes the length: a resumed request aims where it did before
            lengths = ResponseLengths(median, self.len_sigma, r.max_new_tokens)
            self.target[r.request_id] = lengths.for_key(self.seed, str(r.request_id))  # the id as text: its edge
            self.waiting.append(seq)

    def _spend(self, dt: float) -> None:
        """Modelled seconds, as wall time."""
        time.sleep(dt * self.time_scale)

    def step(self) -> list[GenOutput]:
        done = self._take_ready()
        if self.paused or not (self.running or self.waiting):
            return done
        prefill = 0
        while self.waiting and len(self.running) < self.capacity:
            seq = self.waiting.popleft()
            prefill += len(seq.request.prompt_ids) + len(seq.ids)
            self.running.append(seq)
        self.prefill_tokens += prefill
        context = sum(len(s.request.prompt_ids) + len(s.ids) for s in self.running)
        self._spend(self.cost.prefill_s(prefill) + float(self.cost.decode_step_s(len(self.running), context)))
        tokens = self._not_stop[self.rng.integers(0, len(self._not_stop), len(self.running))]
        logprobs = -self.rng.exponential(1.0, len(self.running))
        still = []
        for seq, tok, lp in zip(self.running, tokens.tolist(), logprobs.tolist()):
            rid = seq.request.request_id
            at_target = len(seq.ids) + 1 >= self.target[rid] and not self.ignore_eos
            seq.ids.append(self.eos if at_target else tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            reason = "stop" if at_target else "length" if seq.budget <= 0 else None
            if reason is None:
                still.append(seq)
            else:
                done.append(seq.output(reason))
                del self.target[rid]
        self.running = still
        return done

    def interrupt(self, ids: list[Hashable] | None = None) -> list[GenOutput]:
        want = None if ids is None else set(ids)
        out = []

        def keep(seq: InFlight) -> bool:
            if want is None or seq.request.request_id in want:
                out.append(seq.output("abort"))
                self.target.pop(seq.request.request_id, None)
                return False
            return True

        self.running = [s for s in self.running if keep(s)]
        self.waiting = deque(s for s in self.waiting if keep(s))
        return out

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int, keep_kv: bool = False) -> None:
        if self.running and not keep_kv:
            raise RuntimeError("update_weights with requests running; interrupt or let them finish first")
        for k, v in state_dict.items():
            self._weights[k].copy_(v)
        # the real payload was small; the cost model's transfer of the model's bytes and reload stand here
        self._spend(self.cost.sync_s)
        self.version = version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._weights

    def close(self) -> None:
        self.running, self.waiting, self.target = [], deque(), {}
