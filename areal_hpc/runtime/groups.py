"""A generator's group of n episodes: its book while it runs, and once ended its spans and its store records."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_hpc.data import Problem
from areal_hpc.rollout import group_counts, group_summary
from areal_hpc.types import SampleId, Trajectory
from areal_hpc.workflow import FinishedEpisode
from areal_hpc.workflow.samples import to_trajectories


@dataclass
class Group:
    problem: Problem
    t_start: float  # granted (its episodes start at the next poll)
    episodes: dict[int, FinishedEpisode] = field(default_factory=dict)  # sample -> its finished episode
    rejected: dict[int, int] = field(default_factory=dict)  # sample -> episodes the workflow rejected in a row
    rejected_stats: list = field(default_factory=list)  # their EpisodeStats: their failures count too


def group_spans(g: Group, episodes: list[FinishedEpisode]) -> list[tuple[str, float, float]]:
    """The timeline's spans of an ended group: the group, its rewards, each tool call."""
    spans = [("group", g.t_start, max(e.t_end for e in episodes))]
    rewards = [e.stats.reward_span for e in episodes if e.stats.reward_span]
    if rewards:
        spans.append(("reward", min(a for a, _ in rewards), max(b for _, b in rewards)))
    spans += [("tool", a, b) for e in episodes for a, b in e.stats.tool_spans]
    return spans


def group_records(
    g: Group, group_id: int, episodes: list[FinishedEpisode], gen_rank: int
) -> tuple[list[Trajectory], dict]:
    """An ended group's trajectories, token for token, and its GROUPS_DONE entry: rank 0 counts its episodes
    whatever becomes of the group (and the failures of its rejected episodes)."""
    p = g.problem
    trajs = [
        t
        for s, e in enumerate(episodes)
        for t in to_trajectories(e, SampleId(group_id, s), p.prompt_id, gen_rank, p.row_index)
    ]
    counts = group_counts([e.stats for e in episodes], g.rejected_stats)
    return trajs, group_summary(trajs, p.prompt_id, group_id) | counts
