"""The engine interfaces the runtime talks to (generation: sample with versions; training: PPO steps)."""

from __future__ import annotations

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
