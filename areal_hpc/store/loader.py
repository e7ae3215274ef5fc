"""Turns a run's shards and ledger into a pandas DataFrame, one row per trajectory."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from areal_hpc.rundir import RunDir
from areal_hpc.store.columns import EPISODE_COUNTS, EPISODE_DTYPES, episode_owners
from areal_hpc.store.ledger import Ledger
from areal_hpc.store.shard_schema import TRAJ_FIELDS
from areal_hpc.store.shards import CorruptShardError, ShardSummary, list_shards, read_shard_summary

COLUMNS = (
    *TRAJ_FIELDS,
    *EPISODE_COUNTS,
    "n_tokens",
    "shard",
    "index",
    "consumed_version",
    "staleness",
)


def _empty_frame() -> pd.DataFrame:
    dtypes = {name: dt.newbyteorder("=") for name, dt in (TRAJ_FIELDS | EPISODE_DTYPES).items()}
    dtypes["finish_reason"] = np.dtype(object)
    dtypes.update(
        n_tokens=np.dtype(np.int64),
        shard=np.dtype(object),
        index=np.dtype(np.int64),
        consumed_version=np.dtype(np.int64),
        staleness=np.dtype(np.float64),
    )
    df = pd.DataFrame({c: pd.Series([], dtype=dtypes[c]) for c in COLUMNS})
    for c in ("finish_reason", "shard"):
        df[c] = df[c].astype(str)  # the same string dtype a filled frame gets
    return df


def load_trajectories(
    run_dir: os.PathLike | str, verify_tokens: bool = True, rows: bool | os.PathLike | str = False
) -> pd.DataFrame:
    """One row per trajectory in RUN_DIR/rollouts/, joined with the ledger.

    consumed_version is the version that consumed the trajectory (-1 if none); staleness is
    consumed_version - version_start (NaN if not consumed). The episode counts (turns, tool_calls, tool_errors,
    tool_s, reward_timeouts, reward_errors: the shard's episode table) are joined onto each episode's first
    trajectory, 0 on its others, so sums count each episode once. Corrupt shards are skipped with a warning and
    named in df.attrs["corrupt_shards"]. verify_tokens=False checks only the summary checksum (no token
    data read), which is much faster on big runs but cannot notice damaged token arrays.

    rows=True joins each trajectory's dataset row (by row_index) as `row.<field>` columns, from the file the
    run recorded in RUN_DIR/dataset.json (rows=PATH: a copy of it); ValueError if the data is not that file.
    """
    run_dir = Path(run_dir)
    consumed = Ledger(run_dir).consumed()
    parts = []
    corrupt: list[str] = []
    for path in list_shards(RunDir(run_dir).rollouts):
        try:
            s = read_shard_summary(path, verify_tokens=verify_tokens)
        except CorruptShardError as e:
            warnings.warn(f"skipping {e}", stacklevel=2)
            corrupt.append(path.name)
            continue
        n = s.n_trajectories
        cols = {name: getattr(s, name) for name in TRAJ_FIELDS} | _episode_counts(s)
        cols["n_tokens"] = s.n_tokens
        cols["shard"] = np.full(n, path.name, dtype=object)
        cols["index"] = np.arange(n, dtype=np.int64)
        cols["consumed_version"] = np.array([consumed.get((path.name, i), -1) for i in range(n)], dtype=np.int64)
        parts.append(pd.DataFrame(cols))
    if parts:
        df = pd.concat(parts, ignore_index=True)
        cv = df["consumed_version"]
        df["staleness"] = (cv - df["version_start"]).astype(np.float64).where(cv >= 0, np.nan)
        df = df[list(COLUMNS)]
    else:
        df = _empty_frame()
    known = {(name, i) for name, i in zip(df["shard"], df["index"])} if len(df) else set()
    df.attrs["corrupt_shards"] = corrupt
    # Ledger entries whose shard is gone or unreadable: worth knowing when auditing exactly-once.
    df.attrs["unmatched_ledger_entries"] = sum(1 for e in consumed if e not in known)
    if rows is not False:
        from areal_hpc.data.record import dataset_rows, join_rows

        df = join_rows(df, dataset_rows(run_dir, None if rows is True else rows))
    return df


def _episode_counts(s: ShardSummary) -> dict[str, np.ndarray]:
    """The episode table's counts as per-trajectory columns: on each episode's first trajectory, 0 elsewhere."""
    owners = episode_owners(s.columns, s.episodes)
    out = {}
    for k in EPISODE_COUNTS:
        col = np.zeros(s.n_trajectories, dtype=EPISODE_DTYPES[k].newbyteorder("="))
        col[owners] = s.episodes[k]
        out[k] = col
    return out
