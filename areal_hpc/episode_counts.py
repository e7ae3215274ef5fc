"""Rollout records: a group's requests made outside a runner (tests, benchmarks), group and episode sums."""

from __future__ import annotations

import numpy as np

from areal_hpc.store.columns import Batch, as_columns
from areal_hpc.types import GenRequest, RequestId, SampleId, Trajectory


def group_requests(prompt_ids: list[int], group_id: int, n_samples: int, max_new_tokens: int) -> list[GenRequest]:
    """n requests for one prompt, each the first call of sample s's episode (outputs regroup by their ids)."""
    return [GenRequest(sample_request(group_id, s), list(prompt_ids), max_new_tokens) for s in range(n_samples)]


def sample_request(group_id: int, sample: int) -> RequestId:
    """The id of the first (only) call of a training sample's episode, for requests made outside a runner."""
    return RequestId(SampleId(group_id, sample), 0)


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


# what GROUPS_DONE carries of a group's episodes, whatever becomes of the group: rank 0 adds them up
GROUP_COUNTS = ("episodes", "turns", "tool_calls", "reward_timeouts", "reward_errors", "branches", "agent_failures")


def group_counts(stats: list, rejected: list = ()) -> dict:
    """The counts of a group's episodes (their EpisodeStats) and, per number they logged (reward/<key>,
    episode/<name>), its sum and how many episodes logged it. `rejected`: the stats of episodes the workflow
    rejected (or that failed) and ran again, whose reward failures, branches and failures count too; the failures
    by kind."""
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
    return {
        "episodes": len(stats),
        "turns": sum(st.turns for st in stats),
        "tool_calls": sum(st.tool_calls for st in stats),
        "reward_timeouts": sum(st.reward_timeouts for st in every),
        "reward_errors": sum(st.reward_errors for st in every),
        "branches": sum(st.branches for st in every),
        "agent_failures": sum(st.agent_failures for st in every),
        "failure_kinds": kinds,
        "logged": logged,
    }


def episode_stats(trajs: Batch) -> dict:
    """Sums over trajectories (columns or records) of what their episodes did, as a version's metrics row adds
    them up."""
    c = as_columns(trajs)
    e = c.episodes  # the episodes whose first trajectory is here: each counted once
    after_prompt = int(c.offsets[-1]) - int(c.seqs["prompt_len"].sum())
    trained = int(c.tokens["loss_mask"].sum(dtype=np.int64))
    return {
        "turns_sum": int(e["turns"].sum()),
        "tool_calls": int(e["tool_calls"].sum()),
        "tool_errors": int(e["tool_errors"].sum()),
        "tool_s": float(e["tool_s"].astype(np.float64).sum()),
        "trained_tokens": trained,
        # tokens after the prompt that are not trained: a workflow's own, and turns generated with train=False
        "unsampled_tokens": int(after_prompt - trained),
    }


def episode_metrics(stats: list[dict], samples: int) -> dict:
    """A version's episode columns in metrics.csv from the episode_stats of its parts."""
    trained = sum(x["trained_tokens"] for x in stats)
    unsampled = sum(x["unsampled_tokens"] for x in stats)
    row = {k: sum(x[k] for x in stats) for k in EPISODE_SUMS}
    return row | {
        "turns_mean": sum(x["turns_sum"] for x in stats) / max(samples, 1),
        "trained_share": trained / max(trained + unsampled, 1),  # of the tokens after the prompt
    }


# (reward time-outs and errors are counted over every generated episode instead: GROUP_COUNTS)
EPISODE_SUMS = ("tool_calls", "tool_errors", "tool_s", "unsampled_tokens")
