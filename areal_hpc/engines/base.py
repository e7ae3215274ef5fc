"""The engine interfaces the runtime talks to (generation: sample with versions; training: PPO steps)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from areal_hpc.types import GenOutput, GenRequest, Trajectory


class GenerationEngine(Protocol):
    version: int
    ignore_eos: bool  # True: every sequence runs to max_new_tokens (benchmarks, tests)

    def generate(self, requests: list[GenRequest], greedy: bool = False) -> list[GenOutput]:
        """Sample continuations. If abort() is called meanwhile, return partial outputs ('abort')."""

    def abort(self) -> None:
        """Thread-safe: make the running generate() return at the next token with partial outputs.

        An abort that reaches no running call stays pending for the next one until clear_abort().
        """

    def clear_abort(self) -> None:
        """Forget a pending abort (call when nothing is generating)."""

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights in place; tokens sampled afterwards carry `version`."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights now loaded, in the trainer's names (receive buffers and checksums are built from it)."""

    def close(self) -> None:
        """Release what the engine holds outside Python objects (vLLM's engine core)."""


class GenerationBase:
    """What the generation engines share: the abort flag, the version, and assembling the outputs."""

    def __init__(self) -> None:
        self.version = 0
        self.ignore_eos = False
        self._abort = threading.Event()
        # held around each engine step and each weight load: a step never sees half-loaded weights, and
        # the version read inside it is the version of the weights that sampled the token
        self._lock = threading.Lock()

    def abort(self) -> None:
        self._abort.set()

    def clear_abort(self) -> None:
        self._abort.clear()

    def generate(self, requests: list[GenRequest], greedy: bool = False) -> list[GenOutput]:
        try:
            return self._generate(requests, greedy)
        finally:
            self._abort.clear()  # cleared on the way out, so an abort sent before the call still counts

    def _generate(self, requests: list[GenRequest], greedy: bool) -> list[GenOutput]:
        raise NotImplementedError

    @staticmethod
    def _outputs(requests: list[GenRequest], ids: list, logprobs: list, versions: list, reasons: list) -> list[GenOutput]:
        """One GenOutput per request; a request with no finish reason was aborted."""
        return [
            GenOutput(request_id=r.request_id, prompt_ids=list(r.prompt_ids), output_ids=ids[i],
                      output_logprobs=logprobs[i], output_versions=versions[i], finish_reason=reasons[i] or "abort")
            for i, r in enumerate(requests)
        ]


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
