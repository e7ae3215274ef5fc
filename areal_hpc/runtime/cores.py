"""Which CPU cores each role's ranks run on when one host holds every role (`cluster.pin_roles`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from areal_hpc.runtime.comm.layout import GENERATOR


@dataclass(frozen=True)
class CoreSplit:
    """A host's cores in two parts: generation's and everything else's (scheduler, trainers, reward workers).

    On a GPU cluster generation has devices of its own and scoring runs on host cores beside them. On one
    CPU host every rank would otherwise share every core, so the trainer's steps and the scoring would
    slow each engine step by whatever time slices they take; split, the generator's cores do nothing
    but generate, as its GPUs would.
    """

    generation: frozenset[int]
    other: frozenset[int]

    @classmethod
    def of(cls, cores: set[int] | frozenset[int]) -> CoreSplit:
        """Generation takes the upper half (the larger one when the count is odd); one core is shared."""
        ordered = sorted(cores)
        if not ordered:
            raise ValueError("no cores to split")
        if len(ordered) == 1:
            return cls(frozenset(ordered), frozenset(ordered))
        half = len(ordered) // 2
        return cls(frozenset(ordered[half:]), frozenset(ordered[:half]))

    def of_role(self, role: str) -> frozenset[int]:
        return self.generation if role == GENERATOR else self.other


def pin_process(cores: frozenset[int]) -> None:
    """Every thread of this process onto `cores` (MPI and torch started threads already); later ones inherit."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended since the listing
            pass
