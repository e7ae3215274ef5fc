"""A trainer's shards, read and verified once, kept across versions until the ledger has consumed them."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from areal_hpc.store.columns import TrajectoryColumns
from areal_hpc.store.shards import read_columns

# What one trainer keeps at most. A shard is dropped once the ledger has consumed all of it, so in a run only
# the shards that straddle a batch stay: the bound is for a share dealt from many half-used shards.
CACHE_BYTES = 2 << 30


class ShardCache:
    """Shards of `rollouts` as columns, each read (and its checksum verified) once by this trainer.

    `consumed(entries)` takes the ledger's entries of each version: a shard all of whose trajectories are
    consumed is dropped, as no later batch can deal them. Past `max_bytes` the least recently used go first.
    """

    def __init__(self, rollouts: os.PathLike | str, max_bytes: int = CACHE_BYTES):
        self.rollouts = Path(rollouts)
        self.max_bytes = max_bytes
        self.shards: OrderedDict[str, TrajectoryColumns] = OrderedDict()
        # shard -> how many of its trajectories the ledger has consumed since this trainer started (a count: the
        # ledger names each once); one that began before (a resume) is never complete here: the bound drops it
        self.used: dict[str, int] = {}
        self.reads = 0

    def get(self, name: str) -> TrajectoryColumns:
        if name in self.shards:
            self.shards.move_to_end(name)
            return self.shards[name]
        cols = read_columns(self.rollouts / name)
        self.reads += 1
        self.shards[name] = cols
        self._bound()
        return cols

    def consumed(self, entries: Iterable[tuple[str, int]]) -> None:
        """The ledger's entries of a version: every shard they complete is dropped."""
        touched = set()
        for name, _ in entries:
            self.used[name] = self.used.get(name, 0) + 1
            touched.add(name)
        for name in touched:
            cols = self.shards.get(name)
            if cols is not None and self.used[name] >= len(cols):
                del self.shards[name]
                del self.used[name]

    def nbytes(self) -> int:
        return sum(_nbytes(c) for c in self.shards.values())

    def _bound(self) -> None:
        total = self.nbytes()
        while len(self.shards) > 1 and total > self.max_bytes:  # the one just read always stays
            _, cols = self.shards.popitem(last=False)
            total -= _nbytes(cols)


def _nbytes(c: TrajectoryColumns) -> int:
    tables = (c.tokens, c.seqs, c.episodes)
    return c.offsets.nbytes + sum(a.nbytes for t in tables for a in t.values())
