"""Episode counts added up: a group's for GROUPS_DONE, a batch's for its trainer, a version's for metrics.csv."""

from __future__ import annotations

import numpy as np

from areal_hpc.count_schema import FAILURES, SENT, TRAINED_MEANS, TRAINED_SUMS
from areal_hpc.store.columns import Batch, as_columns
from areal_hpc.types import Trajectory


def group_summary(trajs: list[Trajectory], prompt_id: int, group_id: int) -> dict:
    """What a generator announces of one scored group (GROUPS_DONE; the shard indices are added when written)."""
    return {
        "prompt_id": prompt_id,
        "group_id": group_id,
        "n_tokens": int(sum(len(t.input_ids) for t in trajs)),
        "gen_tokens": int(sum(t.gen_len for t in trajs)),
        "version_start": int(min(t.version_start for t in trajs)),
        # the reward every sample got when they all got the same (no learning signal; rank 0 may reject the
        # group, and counts such groups by value), else None
        "uniform": float(trajs[0].reward) if len({t.reward for t in trajs}) == 1 else None,
    }


def group_counts(stats: list, rejected: list = ()) -> dict:
    """The counts of a group's episodes (their EpisodeStats: count_schema.GROUP_COUNTS) and, per
    number they logged (reward/<key>, episode/<name>), its sum and how many episodes logged it. `rejected`: the
    stats of episodes the workflow rejected (or that failed) and ran again, whose failure counts (reward
    failures, branches, failures) count too; the failures by kind."""
    logged: dict[str, tuple[float, int]] = {}
    every = [*stats, *rejected]
    kinds: dict[str, int] = {}
    for st in every:
        for kind, n in st.failure_kinds.items():
            kinds[kind] = kinds.get(kind, 0) + n
    for st in stats:
        for k, v in st.logged.items():
            total, n = logged.get(k, (0.0, 0))
            logged[k] = (total + v, n + 1)
    sums = {k: sum(getattr(st, k) for st in (every if k in FAILURES else stats)) for k in SENT}
    return {"episodes": len(stats), **sums, "failure_kinds": kinds, "logged": logged}


def episode_stats(trajs: Batch) -> dict:
    """Sums over trajectories (columns or records) of what their episodes did, as a version's metrics row adds
    them up: each "trained" count of the schema (<name>_sum for those shown as means), and the tokens trained."""
    c = as_columns(trajs)
    e = c.episodes  # the episodes whose first trajectory is here: each counted once
    after_prompt = int(c.offsets[-1]) - int(c.seqs["prompt_len"].sum())
    trained = int(c.tokens["loss_mask"].sum(dtype=np.int64))
    sums = {k: _sum(e[k]) for k in TRAINED_SUMS} | {f"{k}_sum": _sum(e[k]) for k in TRAINED_MEANS}
    return sums | {
        "trained_tokens": trained,
        # tokens after the prompt that are not trained: a workflow's own, and turns generated with train=False
        "unsampled_tokens": int(after_prompt - trained),
    }


def _sum(column: np.ndarray) -> int | float:
    return float(column.astype(np.float64).sum()) if column.dtype.kind == "f" else int(column.sum(dtype=np.int64))


def episode_metrics(stats: list[dict], samples: int) -> dict:
    """A version's episode columns in metrics.csv from the episode_stats of its parts: the "trained" counts'
    sums (or <name>_mean, per sample), the tokens not sampled, and the share of those after the prompt trained."""
    trained = sum(x["trained_tokens"] for x in stats)
    unsampled = sum(x["unsampled_tokens"] for x in stats)
    row = {k: sum(x[k] for x in stats) for k in EPISODE_SUMS}
    return row | {
        **{f"{k}_mean": sum(x[f"{k}_sum"] for x in stats) / max(samples, 1) for k in TRAINED_MEANS},
        "trained_share": trained / max(trained + unsampled, 1),  # of the tokens after the prompt
    }


# a version's sums over its trained episodes ("generated" counts are summed over every generated episode instead:
# runtime.reporting.generated)
EPISODE_SUMS = (*TRAINED_SUMS, "unsampled_tokens")
