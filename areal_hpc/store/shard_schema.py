"""What each shard schema version stores, in checksum order, and an older shard's episode table as today's (pure)."""

from __future__ import annotations

import dataclasses

import numpy as np

from areal_hpc import count_schema
from areal_hpc.store.columns import (
    EPISODE_COUNTS,
    EPISODE_DTYPES,
    SEQ_DTYPES,
    TOKEN_COLUMNS,
    TOKEN_DTYPES,
    episode_keys,
)
from areal_hpc.types import Trajectory

# 2: episode counts (turns, tool calls, reward failures) per trajectory; 3: the dataset row index; 4: the episode
# counts in an episode table, one row per episode (they had ridden on each episode's first trajectory)
SCHEMA_VERSION = 4

# Explicit little-endian dtypes (store/columns.py) so the checksummed bytes are the same on every platform; TRAJ_FIELDS
# in checksum order (SCHEMA_FIELDS: each schema version's).
TOKEN_FIELDS = TOKEN_DTYPES
OFFSETS_DTYPE = np.dtype("<i8")
TRAJ_FIELDS = SEQ_DTYPES
# The Trajectory fields stored as given (all but the token arrays), and the properties stored beside them so
# that a summary (no token data) has them too. TRAJ_FIELDS, in checksum order, must hold exactly these.
STORED_AS_GIVEN = tuple(f.name for f in dataclasses.fields(Trajectory) if f.name not in TOKEN_FIELDS)
DERIVED_FIELDS = ("gen_len", "version_start", "version_end")
if set(TRAJ_FIELDS) != {*STORED_AS_GIVEN, *DERIVED_FIELDS} or tuple(TOKEN_FIELDS) != TOKEN_COLUMNS:
    raise ImportError("areal_hpc.store.shard_schema: TRAJ_FIELDS/TOKEN_FIELDS disagree with the Trajectory dataclass")
# The episode table's datasets, in the HDF5 group "episodes" (EpisodeCounts, keyed by group_id and sample_idx)
EPISODE_FIELDS = {f"episodes/{k}": dt for k, dt in EPISODE_DTYPES.items()}
# The counts schema 4 was first written with: every schema-4 shard has them. A count added to count_schema.COUNTS
# since is a further dataset after them (ADDED_EPISODE_FIELDS): new shards write it, a shard without it reads it
# at its unset value, so adding a count needs no new schema version.
FIRST_COUNTS = ("turns", "tool_calls", "tool_errors", "tool_s", "reward_timeouts", "reward_errors")
ADDED_EPISODE_FIELDS = tuple(f"episodes/{k}" for k in EPISODE_COUNTS if k not in FIRST_COUNTS)
# Schemas 2 and 3 kept the counts per trajectory instead, on each episode's first (0 on its others).
LEGACY_COUNTS = {k: EPISODE_DTYPES[k] for k in FIRST_COUNTS}
# The datasets each schema version stores after offsets, in checksum order: shards of every version still read (a
# resumed run, an old run's analysis), with a field its schema lacks at the Trajectory's default, and an episode
# table made from the per-trajectory counts (schema 1: EpisodeCounts' defaults).
_FIRST = tuple(TRAJ_FIELDS)[:12]  # prompt_id .. t_end
SCHEMA_FIELDS: dict[int, tuple[str, ...]] = {
    1: _FIRST,
    2: (*_FIRST, *LEGACY_COUNTS),
    3: (*_FIRST, *LEGACY_COUNTS, "row_index"),
    4: (*TRAJ_FIELDS, "episodes/group_id", "episodes/sample_idx", *(f"episodes/{k}" for k in FIRST_COUNTS)),
}
TRAJ_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Trajectory) if f.name in TRAJ_FIELDS}
# Fixed order for the checksums; the summary checksum lets the scheduler verify without token data.
SUMMARY_ORDER = ("offsets", *SCHEMA_FIELDS[SCHEMA_VERSION], *ADDED_EPISODE_FIELDS)
CHECKSUM_ORDER = (*TOKEN_FIELDS, *SUMMARY_ORDER)
FIELD_DTYPES = {**TOKEN_FIELDS, "offsets": OFFSETS_DTYPE, **TRAJ_FIELDS, **LEGACY_COUNTS, **EPISODE_FIELDS}


def todays_episode_table(arrays: dict[str, np.ndarray], schema: int) -> dict[str, np.ndarray]:
    """The episode-table datasets a shard of `schema` lacks today: all of them for schemas 1-3 (from the
    per-trajectory counts), and the counts added since schema 4 began, at their unset values."""
    out = legacy_episodes(arrays) if schema < 4 else {}
    n = len((out or arrays)["episodes/group_id"])
    for name in ADDED_EPISODE_FIELDS:
        if name not in arrays and name not in out:  # a count added after the shard was written
            out[name] = np.full(n, count_schema.UNSET[name.removeprefix("episodes/")], dtype=FIELD_DTYPES[name])
    return out


def legacy_episodes(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The episode table of a schema 1-3 shard: per (group_id, sample_idx), the sum of its trajectories' counts
    (they sat on its first, 0 on the others), or the counts' unset values where the schema kept none."""
    (keys,) = episode_keys(arrays)
    _, rows, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(rows)  # the episodes in the order they first appear
    first = rows[order]
    out = {"episodes/group_id": arrays["group_id"][first], "episodes/sample_idx": arrays["sample_idx"][first]}
    for k in EPISODE_COUNTS:
        dt = EPISODE_DTYPES[k]
        if k in arrays:
            sums = np.zeros(len(rows), dtype=np.float64 if dt.kind == "f" else np.int64)
            np.add.at(sums, inverse.ravel(), arrays.pop(k))
            out[f"episodes/{k}"] = sums[order].astype(dt)
        else:
            out[f"episodes/{k}"] = np.full(len(rows), count_schema.UNSET[k], dtype=dt)
    return out
