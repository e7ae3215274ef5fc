"""The engine interfaces the runtime talks to (generation: step-driven sampling with versions; training: PPO steps)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from areal_hpc.types import GenOutput, GenRequest, Trajectory


class GenerationEngine(Protocol):
    """Step-driven generation: requests join the running batch at any step and leave in the step they finish.

    Nothing here blocks for longer than one engine step, so the caller (a generator's main loop) keeps
    answering MPI between steps. Per token an output records the sampled id, its behaviour logprob under
    softmax(logits / temperature) and the weight version that sampled it.
    """

    version: int
    ignore_eos: bool  # True: every sequence runs to max_new_tokens (benchmarks, tests)
    capacity: int  # sequences one step can hold; more are queued and join as slots free

    @property
    def num_running(self) -> int:
        """Requests in the running batch now (at most `capacity`)."""

    @property
    def num_waiting(self) -> int:
        """Requests added that wait for a slot."""

    def add(self, requests: list[GenRequest]) -> None:
        """The requests join the running batch at the next step (queued if it is full)."""

    def step(self) -> list[GenOutput]:
        """One engine step: every running request gets one token; returns those that finished in it."""

    def interrupt(self, ids: list[str] | None = None) -> list[GenOutput]:
        """End these running or waiting requests (None: all) and return their partial outputs ('abort').

        Adding `request.resumed(output)` later continues each exactly where it stopped.
        """

    def pause(self) -> None:
        """Stop stepping: step() does nothing until resume()."""

    def resume(self) -> None: ...

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights in place (nothing may be running); tokens sampled afterwards carry `version`."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights now loaded, in the trainer's names (receive buffers and checksums are built from it)."""

    def close(self) -> None:
        """Release what the engine holds outside Python objects (vLLM's engine core)."""


def generate(engine: GenerationEngine, requests: list[GenRequest]) -> list[GenOutput]:
    """The batch call (evaluation, the single-process loop): add every request, step until all are back.

    For an engine with nothing else in flight; outputs come back in request order.
    """
    want = {r.request_id for r in requests}
    if len(want) != len(requests):
        raise ValueError("generate: request ids must be unique")
    engine.add(requests)
    done: dict[str, GenOutput] = {}
    while len(done) < len(want):
        for o in engine.step():
            if o.request_id in want:
                done[o.request_id] = o
    return [done[r.request_id] for r in requests]


@dataclass
class InFlight:
    """One request inside an engine: what it asked for and what it has produced so far."""

    request: GenRequest
    ids: list[int]
    logprobs: list[float]
    versions: list[int]

    @classmethod
    def of(cls, r: GenRequest) -> "InFlight":
        return cls(r, list(r.partial_ids), list(r.partial_logprobs), list(r.partial_versions))

    @property
    def budget(self) -> int:
        """Tokens still to sample."""
        return self.request.max_new_tokens - len(self.ids)

    def output(self, reason: str) -> GenOutput:
        r = self.request
        return GenOutput(request_id=r.request_id, prompt_ids=list(r.prompt_ids), output_ids=self.ids,
                         output_logprobs=self.logprobs, output_versions=self.versions, finish_reason=reason)


class GenerationBase:
    """What the generation engines share: version, pause flag, capacity and the requests done before a step."""

    def __init__(self, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.version = 0
        self.ignore_eos = False
        self.capacity = max_num_seqs
        self.paused = False
        self._ready: list[GenOutput] = []  # finished without a step (no budget left); returned by the next step

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def _admit(self, r: GenRequest) -> InFlight | None:
        """The engine's record of a new request, or None when it has nothing left to sample."""
        seq = InFlight.of(r)
        if seq.budget <= 0:
            self._ready.append(seq.output("length"))
            return None
        return seq

    def _take_ready(self) -> list[GenOutput]:
        out, self._ready = self._ready, []
        return out

    def _finish_reason(self, seq: InFlight, token: int, stop_ids: set[int]) -> str | None:
        if token in stop_ids and not self.ignore_eos:
            return "stop"
        return "length" if seq.budget <= 0 else None


class TrainEngine(Protocol):
    version: int

    def compute_logprobs(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        """Per-token log p(token_t | tokens_<t) under the current weights (position 0 gets 0)."""

    def ppo_update(self, trajectories: list[Trajectory], advantages: np.ndarray) -> dict[str, float]:
        """One training step (ppo_n_minibatches optimizer steps) on this rank's share; version += 1."""

    def weights(self) -> dict[str, torch.Tensor]:
        """Full weights for publishing to generators."""

    def export_hf(self, path: Path) -> Path:
        """Save a Hugging Face folder (safetensors + tokenizer) loadable by transformers/vLLM."""

    def save_checkpoint(self, path: Path) -> None: ...

    def load_checkpoint(self, path: Path) -> None: ...
