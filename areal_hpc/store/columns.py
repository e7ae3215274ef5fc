"""Trajectories as columns: per-token arrays laid end to end with offsets, and one array per per-sequence field."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from areal_hpc import count_schema
from areal_hpc.types import EpisodeCounts, Trajectory

# The columns' dtypes, as the store keeps them: explicit little-endian, so checksummed bytes are the same everywhere.
TOKEN_DTYPES: dict[str, np.dtype] = {
    "input_ids": np.dtype("<i4"),
    "behav_logprobs": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
}
TOKEN_COLUMNS = tuple(TOKEN_DTYPES)
# one value per sequence: the Trajectory's other fields and three of its properties (gen_len, version_start,
# version_end), in the store's checksum order (store.shard_schema.SCHEMA_FIELDS: what each shard schema version stored)
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
    "row_index": np.dtype("<i8"),
}
DTYPES = {**TOKEN_DTYPES, **SEQ_DTYPES}
# the Trajectory fields kept one value per sequence (all but the per-token arrays)
SEQ_COLUMNS = tuple(f.name for f in dataclasses.fields(Trajectory) if f.name not in TOKEN_COLUMNS)
# one row per episode (EpisodeCounts), keyed by (group_id, sample_idx): an episode that left several transcripts
# (branch()) is counted once, whichever of them a trainer is dealt. Its counts are the schema's stored ones.
_KEY = np.dtype([("group_id", "<i8"), ("sample_idx", "<i8")])
EPISODE_DTYPES: dict[str, np.dtype] = {k: _KEY[k] for k in _KEY.names} | count_schema.DTYPES
EPISODE_COUNTS = count_schema.STORED


def no_episodes() -> dict[str, np.ndarray]:
    """An empty episode table."""
    return {k: np.zeros(0, dtype=dt) for k, dt in EPISODE_DTYPES.items()}


def episode_keys(*tables: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The (group_id, sample_idx) of each row of each table (sequences' or episodes' columns), as one sortable
    array per table, comparable across them: group_id * (largest sample_idx + 1) + sample_idx where that fits in
    int64 (sorting pairs costs ~20x more), else (group_id, sample_idx) records."""
    g, s = [t["group_id"] for t in tables], [t["sample_idx"] for t in tables]
    lo = min((min(int(a.min()), int(b.min())) for a, b in zip(g, s) if len(a)), default=0)
    width = max((int(b.max()) for b in s if len(b)), default=0) + 1
    if lo >= 0 and all(not len(a) or int(a.max()) < (1 << 62) // width for a in g):
        return [a.astype(np.int64) * width + b for a, b in zip(g, s)]
    out = [np.empty(len(a), dtype=_KEY) for a in g]
    for keys, a, b in zip(out, g, s):
        keys["group_id"], keys["sample_idx"] = a, b
    return out


def episode_problem(seqs: dict[str, np.ndarray], episodes: dict[str, np.ndarray]) -> str | None:
    """What is wrong with an episode table for these sequences (None: nothing): it must hold one row per
    (group_id, sample_idx) the sequences have, and no other."""
    lens = {k: len(a) for k, a in episodes.items()}
    if set(lens) != set(EPISODE_DTYPES) or len(set(lens.values())) != 1:
        return f"episode table columns {lens}, expected {list(EPISODE_DTYPES)} of one length"
    seq_keys, have = episode_keys(seqs, episodes)
    want, listed = np.unique(seq_keys), np.unique(have)
    if len(listed) != len(have):
        return "an episode appears twice in the episode table"
    if not np.array_equal(listed, want):
        return f"the episode table's {len(have)} episodes are not the trajectories' {len(want)}"
    return None


def episode_owners(seqs: dict[str, np.ndarray], episodes: dict[str, np.ndarray]) -> np.ndarray:
    """Each episode row's first sequence (its index in `seqs`): dealing that sequence deals the episode's counts,
    so sums over any split of the sequences count each episode once. Every episode must have a sequence."""
    seq_keys, ep_keys = episode_keys(seqs, episodes)
    uniq, first = np.unique(seq_keys, return_index=True)
    return first[np.searchsorted(uniq, ep_keys)]


@dataclass
class TrajectoryColumns:
    """N trajectories as the store keeps them, so the trainer slices instead of building one object each.

    Sequence i's tokens are `tokens[name][offsets[i]:offsets[i + 1]]`; `seqs[name][i]` is its value of a
    per-sequence field (reward, group_id, prompt_len, ...; finish_reason as bytes). `episodes` is the episode
    table (EPISODE_DTYPES) of the episodes whose first sequence is here (episode_owners). `take` and `gather`
    copy; `token` and `split` are views.
    """

    offsets: np.ndarray  # int64 [N+1], from 0
    tokens: dict[str, np.ndarray]  # TOKEN_COLUMNS, each [offsets[-1]]
    seqs: dict[str, np.ndarray]  # per-sequence fields, each [N]
    episodes: dict[str, np.ndarray] = field(default_factory=no_episodes)  # EPISODE_DTYPES, one row per episode

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
    """The sequences `idx` of each part, in order, as one set of columns (every token copied once), with the
    episode rows whose first sequence is picked."""
    picked = [(c, np.asarray(idx, dtype=np.int64)) for c, idx in parts]
    if not sum(len(i) for _, i in picked):
        return from_trajectories([], DTYPES)
    lengths = np.concatenate([c.lengths[i] for c, i in picked])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = {k: _concat_ranges(picked, k) for k in picked[0][0].tokens}
    seqs = {k: np.concatenate([c.seqs[k][i] for c, i in picked]) for k in picked[0][0].seqs}
    rows = [np.isin(episode_owners(c.seqs, c.episodes), i) for c, i in picked]
    episodes = {k: np.concatenate([c.episodes[k][r] for (c, _), r in zip(picked, rows)]) for k in EPISODE_DTYPES}
    return TrajectoryColumns(offsets, tokens, seqs, episodes)


def _concat_ranges(picked: list[tuple[TrajectoryColumns, np.ndarray]], name: str) -> np.ndarray:
    parts = []
    for c, idx in picked:
        a, off = c.tokens[name], c.offsets.tolist()
        parts += [a[off[j] : off[j + 1]] for j in idx.tolist()]
    return np.concatenate(parts)


def from_trajectories(
    trajectories: Sequence[Trajectory], dtypes: dict[str, np.dtype], episodes: Sequence[EpisodeCounts] | None = None
) -> TrajectoryColumns:
    """Trajectory records as columns of `dtypes`: the TOKEN_COLUMNS, and as per-sequence columns every other
    name (a field or a property such as version_start; finish_reason a bytes dtype); `episodes` as the episode
    table (None: an EpisodeCounts of defaults per episode, as for a single generate call). ValueError naming the
    first sequence whose arrays disagree in length, or an episode table that is not one row per episode."""
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
    if episodes is None:
        episodes = [EpisodeCounts(g, s) for g, s in dict.fromkeys((t.group_id, t.sample_idx) for t in trajectories)]
    table = {k: np.asarray([getattr(e, k) for e in episodes], dtype=dt) for k, dt in EPISODE_DTYPES.items()}
    if (problem := episode_problem(seqs, table)) is not None:
        raise ValueError(problem)
    return TrajectoryColumns(offsets, tokens, seqs, table)
