"""Rewards for emulated rollouts: placeholder answers are right with a chance fixed per prompt (no scoring)."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Sequence

from areal_hpc.costmodel import unit_hash
from areal_hpc.reward.pool import Scores


class EmulatedRewards:
    """The reward pool's interface for emulated runs, where answers are placeholder tokens.

    Each prompt (keyed by its reference answer) gets a difficulty: a chance of being right drawn as U**k
    with k = 1/p_correct - 1, so the mean over prompts is p_correct and groups are mixed or uniform about
    as often as on a real dataset of mixed difficulty (what dynamic sampling sees). Each answer is then
    right with that chance, fixed by its text.
    """

    def __init__(self, p_correct: float, seed: int = 0):
        self.k = 1 / p_correct - 1 if p_correct > 0 else None
        self.seed = seed

    def p_uniform(self, n: int) -> float:
        """The chance a group of n answers is all right or all wrong (what dynamic sampling rejects)."""
        if self.k is None:
            return 1.0
        chances = [((i + 0.5) / 1000) ** self.k for i in range(1000)]
        return sum(c**n + (1 - c) ** n for c in chances) / 1000

    def _score(self, completion: str, reference) -> float:
        if self.k is None:
            return 0.0
        if isinstance(reference, dict):  # a dataset row: its answer stands for the prompt
            reference = str(reference.get("answer", ""))
        chance = unit_hash(self.seed, "prompt:" + reference) ** self.k
        return float(unit_hash(self.seed, reference + "\x00" + completion) < chance)

    def submit(self, completions: Sequence[str], references: Sequence) -> cf.Future:
        future: cf.Future = cf.Future()
        future.set_result(Scores([self._score(c, r) for c, r in zip(completions, references)]))
        return future

    def discard(self, future: cf.Future, indices: Sequence[int]) -> None:  # RewardPool's; scored at once here
        pass

    def close(self, finish_queued: bool = True) -> None:  # RewardPool's signature; nothing to stop
        pass

    def __enter__(self) -> EmulatedRewards:  # used as RewardPool is (`with reward_pool_for(cfg) as pool`)
        return self

    def __exit__(self, *exc) -> None:
        self.close()
