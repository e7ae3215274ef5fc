"""Trajectories as columns: per-token arrays laid end to end with offsets, and one array per per-sequence field."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from areal_hpc.types import Trajectory

# The columns' dtypes, as the store keeps them: explicit little-endian, so checksummed bytes are the same everywhere.
TOKEN_DTYPES: dict[str, np.dtype] = {
    "input_ids": np.dtype("<i4"),
    "behav_logprobs": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
}
TOKEN_COLUMNS = tuple(TOKEN_DTYPES)
# one value per sequence: the Trajectory's other fields and three of its properties (gen_len, version_start,
# version_end), in the store's checksum order (each shard schema version adds to the end)
SEQ_DTYPES: dict[str, np.dtype] = {
    "prompt_id": np.dtype("<i8"),
    "group_id": np.dtype("<i8"),
    "sample_idx": np.dtype("<i8"),
    "reward": np.dtype("<f4"),
    "prompt_len": np.dtype("<i4"),
    "gen_len": np.dtype("<i4"),
    "version_start": np.dtype("<i4"),
    "version_end": np.dtype("<i4"),
    "finish_reason": np.dtype("S8"),
    "gen_rank": np.dtype("<i4"),
    "t_start": np.dtype("<f8"),
    "t_end": np.dtype("<f8"),
    "turns": np.dtype("<i4"),
    "tool_calls": np.dtype("<i4"),
    "tool_errors": np.dtype("<i4"),
    "tool_s": np.dtype("<f4"),
    "reward_timeouts": np.dtype("<i4"),
    "reward_errors": np.dtype("<i4"),
    "row_index": np.dtype("<i8"),
}
DTYPES = {**TOKEN_DTYPES, **SEQ_DTYPES}
# the Trajectory fields kept one value per sequence (all but the per-token arrays)
SEQ_COLUMNS = tuple(f.name for f in dataclasses.fields(Trajectory) if f.name not in TOKEN_COLUMNS)


@dataclass
class TrajectoryColumns:
    """N trajectories as the store keeps them, so the trainer slices instead of building one object each.

    Sequence i's tokens are `tokens[name][offsets[i]:offsets[i + 1]]`; `seqs[name][i]` is its value of a
    per-sequence field (reward, group_id, prompt_len, ...; finish_reason as bytes). `take` and `gather`
    copy; `token` and `split` are views.
    """

    offsets: np.ndarray  # int64 [N+1], from 0
    tokens: dict[str, np.ndarray]  # TOKEN_COLUMNS, each [offsets[-1]]
    seqs: dict[str, np.ndarray]  # per-sequence fields, each [N]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def token(self, name: str, i: int) -> np.ndarray:
        """Sequence i's per-token array `name` (a view)."""
        return self.tokens[name][self.offsets[i] : self.offsets[i + 1]]

    def split(self, name: str = "input_ids") -> list[np.ndarray]:
        """Every sequence's per-token array `name`, as views."""
        return np.split(self.tokens[name], self.offsets[1:-1]) if len(self) else []

    def laid_out(self, name: str, idx: Sequence[int]) -> np.ndarray:
        """The per-token arrays `name` of sequences `idx`, end to end (one copy)."""
        a, off = self.tokens[name], self.offsets
        return np.concatenate([a[off[i] : off[i + 1]] for i in idx]) if len(idx) else a[:0].copy()

    def token_sums(self, name: str = "loss_mask") -> np.ndarray:
        """Each sequence's sum of the per-token column `name` (int64 for integer columns)."""
        a = self.tokens[name]
        cs = np.concatenate([[0], np.cumsum(a, dtype=np.float64 if a.dtype.kind == "f" else np.int64)])
        return cs[self.offsets[1:]] - cs[self.offsets[:-1]]

    def take(self, idx: Sequence[int]) -> TrajectoryColumns:
        """Sequences `idx` as their own columns."""
        return gather([(self, idx)])

    def trajectories(self) -> list[Trajectory]:
        """One Trajectory per sequence, its per-token arrays views into these columns."""
        off = self.offsets.tolist()
        cols = {k: self.seqs[k].tolist() for k in SEQ_COLUMNS}  # python scalars in bulk: cheaper than per item
        cols["finish_reason"] = [r.decode("ascii", errors="replace") for r in cols["finish_reason"]]
        rows = [dict(zip(cols, values)) for values in zip(*cols.values())]
        return [
            Trajectory(**row, **{k: self.tokens[k][s:e] for k in TOKEN_COLUMNS})
            for row, s, e in zip(rows, off[:-1], off[1:])
        ]


# what a trainer takes: columns (a trainer rank's shards) or records (tests, the single-process path)
Batch = TrajectoryColumns | Sequence[Trajectory]


def as_columns(batch: Batch) -> TrajectoryColumns:
    """Columns as they are, Trajectory records packed into columns (tests and the single-process path)."""
    return batch if isinstance(batch, TrajectoryColumns) else from_trajectories(batch, DTYPES)


def gather(parts: Sequence[tuple[TrajectoryColumns, Sequence[int]]]) -> TrajectoryColumns:
    """The sequences `idx` of each part, in order, as one set of columns (every token copied once)."""
    picked = [(c, np.asarray(idx, dtype=np.int64)) for c, idx in parts]
    if not sum(len(i) for _, i in picked):
        return from_trajectories([], DTYPES)
    lengths = np.concatenate([c.lengths[i] for c, i in picked])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = {k: _concat_ranges(picked, k) for k in picked[0][0].tokens}
    seqs = {k: np.concatenate([c.seqs[k][i] for c, i in picked]) for k in picked[0][0].seqs}
    return TrajectoryColumns(offsets, tokens, seqs)


def _concat_ranges(picked: list[tuple[TrajectoryColumns, np.ndarray]], name: str) -> np.ndarray:
    parts = []
    for c, idx in picked:
        a, off = c.tokens[name], c.offsets.tolist()
        parts += [a[off[j] : off[j + 1]] for j in idx.tolist()]
    return np.concatenate(parts)


def from_trajectories(trajectories: Sequence[Trajectory], dtypes: dict[str, np.dtype]) -> TrajectoryColumns:
    """Trajectory records as columns of `dtypes`: the TOKEN_COLUMNS, and as per-sequence columns every other
    name (a field or a property such as version_start; finish_reason a bytes dtype). ValueError naming the
    first sequence whose arrays disagree in length."""
    n = len(trajectories)
    lens = np.empty(n, dtype=np.int64)
    for i, t in enumerate(trajectories):
        L = len(t.input_ids)
        for f in TOKEN_COLUMNS[1:]:
            if len(getattr(t, f)) != L:
                raise ValueError(f"trajectory {i}: {f} has length {len(getattr(t, f))}, input_ids has {L}")
        if not 0 <= t.prompt_len <= L:
            raise ValueError(f"trajectory {i}: prompt_len {t.prompt_len} outside [0, {L}]")
        lens[i] = L
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    tokens = {
        f: np.concatenate([np.asarray(getattr(t, f)) for t in trajectories]).astype(dtypes[f], copy=False)
        if offsets[-1]
        else np.zeros(0, dtype=dtypes[f])
        for f in TOKEN_COLUMNS
    }
    width = dtypes["finish_reason"].itemsize
    reasons = []
    for i, t in enumerate(trajectories):
        b = t.finish_reason.encode("ascii")
        if len(b) > width:
            raise ValueError(f"trajectory {i}: finish_reason {t.finish_reason!r} longer than {width} bytes")
        reasons.append(b)
    seqs = {
        f: np.asarray(reasons if f == "finish_reason" else [getattr(t, f) for t in trajectories], dtype=dt)
        for f, dt in dtypes.items()
        if f not in TOKEN_COLUMNS
    }
    return TrajectoryColumns(offsets, tokens, seqs)
