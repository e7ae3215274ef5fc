"""The training prompts' order, one for the synchronous loop and rank 0: a seeded shuffle of the set per epoch."""

from __future__ import annotations

import random


def epoch_order(n_prompts: int, seed: int, epoch: int) -> list[int]:
    """The dataset indices of one epoch, in the order they are drawn (a fresh shuffle each epoch)."""
    order = list(range(n_prompts))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)  # epoch 0 is Random(seed)'s shuffle
    return order


class PromptOrder:
    """The index of the i-th prompt drawn, epoch after epoch; one shuffle is kept (draws go forward)."""

    def __init__(self, n_prompts: int, seed: int):
        if n_prompts <= 0:
            raise ValueError(f"a prompt order needs at least one training prompt, got {n_prompts}")
        self.n_prompts, self.seed = n_prompts, seed
        self._epoch, self._order = -1, []

    def at(self, draw: int) -> int:
        epoch, offset = divmod(draw, self.n_prompts)
        if epoch != self._epoch:  # one shuffle per epoch, not per draw
            self._epoch, self._order = epoch, epoch_order(self.n_prompts, self.seed, epoch)
        return self._order[offset]


def batch_draws(order: PromptOrder, version: int, batch_prompts: int) -> list[int]:
    """The prompts of version `version` (from 1) when every version draws its batch_prompts in turn (the sync loop;
    rank 0 grants the same draws, in the same order, as generators ask)."""
    first = (version - 1) * batch_prompts
    return [order.at(first + i) for i in range(batch_prompts)]
