"""How a trainer cuts sequences into micro-batches, lays each one out, and counts what its forwards computed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from areal_hpc.algo import prefix_tree
from areal_hpc.algo.packing import pack_microbatches
from areal_hpc.engines import micro_batch
from areal_hpc.engines.micro_batch import MicroBatch


@dataclass
class Batching:
    """Micro-batches within `max_tokens` computed positions each: packed (`packing`), with each prefix of at least
    `min_shared` tokens that several sequences share laid down once (`share_prefixes`, packed only), else
    right-padded. The counters add up over forwards until `reset`: positions computed, of which padding, and
    the positions the same forwards stand for (computed with no prefix shared)."""

    max_tokens: int
    packing: bool = True
    share_prefixes: bool = True
    min_shared: int = 32
    pad_token_id: int = 0
    device: torch.device = torch.device("cpu")
    positions: int = 0
    padding: int = 0
    unshared: int = 0

    @property
    def trees(self) -> bool:
        return self.packing and self.share_prefixes

    def reset(self) -> None:
        self.positions = self.padding = self.unshared = 0

    def shares(self, seqs: list[np.ndarray]) -> bool:
        """Whether these sequences have a prefix to lay down once. When they have none (prompts under
        `min_shared`, or all different) they take the plain packed path, as with `share_prefixes` off: packed
        by length, no prefix tree built, plain causal attention per sequence."""
        return self.trees and prefix_tree.shares_a_prefix(seqs, self.min_shared)

    def plan(self, seqs: list[np.ndarray]) -> list[list[int]]:
        """Indices of `seqs`, one list per micro-batch."""
        if not seqs:
            return []
        if self.shares(seqs):
            return prefix_tree.pack_shared(seqs, self.max_tokens, self.min_shared)
        return pack_microbatches([len(s) for s in seqs], self.max_tokens)

    def build(self, seqs: list[np.ndarray]) -> MicroBatch:
        """One micro-batch's model inputs, counted."""
        if self.shares(seqs):
            mb = micro_batch.shared(seqs, prefix_tree.prefix_layout(seqs, self.min_shared), self.device)
        elif self.packing:
            mb = micro_batch.packed(seqs, self.device)
        else:
            mb = micro_batch.padded(seqs, self.pad_token_id, self.device)
        self.count(mb.positions, mb.padding, mb.unshared_positions)
        return mb

    def count(self, positions: int, padding: int, unshared: int) -> None:
        self.positions += positions
        self.padding += padding
        self.unshared += unshared

    def counts(self) -> dict[str, int]:
        """The counters as a trainer's stats: fwd_* for the padding share, train_tokens_* for the sharing's saving."""
        return {
            "fwd_positions": self.positions,
            "fwd_padding": self.padding,
            "train_tokens_computed": self.positions,
            "train_tokens_unshared": self.unshared,
        }
