"""A generator's bookkeeping without MPI or an engine: admission, the group book (episodes -> groups), shards."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from areal_hpc.data import Problem
from areal_hpc.episode_counts import group_counts, group_summary
from areal_hpc.runtime.generation.admission import Admission
from areal_hpc.types import EpisodeCounts, GenRequest, RequestId, SampleId, Trajectory
from areal_hpc.workflow import FinishedEpisode
from areal_hpc.workflow.batch import count_rejection
from areal_hpc.workflow.samples import episode_counts, to_trajectories

Span = tuple[str, float, float]  # a timeline span: (name, start, end)
# a scored group: its trajectories, its episodes' counts (the shard's episode table) and its GROUPS_DONE entry
Records = tuple[list[Trajectory], list[EpisodeCounts], dict]
Shard = tuple[list[Trajectory], list[EpisodeCounts], list[dict], int]  # ShardBuffer.take


@dataclass
class Group:
    """A granted prompt's n episodes while they run."""

    problem: Problem
    t_start: float  # granted (its episodes start at the next poll)
    episodes: dict[int, FinishedEpisode] = field(default_factory=dict)  # sample -> its finished episode
    rejected: dict[int, int] = field(default_factory=dict)  # sample -> episodes the workflow rejected (None)
    rejected_stats: list = field(default_factory=list)  # their EpisodeStats: their failures count too


def group_spans(g: Group, episodes: list[FinishedEpisode]) -> list[Span]:
    """The timeline's spans of an ended group: the group, its rewards, each tool call."""
    spans = [("group", g.t_start, max(e.t_end for e in episodes))]
    rewards = [e.stats.reward_span for e in episodes if e.stats.reward_span]
    if rewards:
        spans.append(("reward", min(a for a, _ in rewards), max(b for _, b in rewards)))
    spans += [("tool", a, b) for e in episodes for a, b in e.stats.tool_spans]
    return spans


def group_records(g: Group, group_id: int, episodes: list[FinishedEpisode], gen_rank: int) -> Records:
    """An ended group's trajectories, token for token, and its GROUPS_DONE entry: rank 0 counts its episodes
    whatever becomes of the group (and the failures of its rejected episodes)."""
    p = g.problem
    trajs = [
        t
        for s, e in enumerate(episodes)
        for t in to_trajectories(e, SampleId(group_id, s), p.prompt_id, gen_rank, p.row_index)
    ]
    counts = group_counts([e.stats for e in episodes], g.rejected_stats)
    table = [episode_counts(e, SampleId(group_id, s)) for s, e in enumerate(episodes)]
    return trajs, table, group_summary(trajs, p.prompt_id, group_id) | counts


def _group_of(request_id: Hashable) -> int | None:
    """The training group a request serves; None for a held-out evaluation's."""
    episode = request_id.episode if isinstance(request_id, RequestId) else None
    return episode.group_id if isinstance(episode, SampleId) else None


class GroupBook:
    """Granted groups from grant to records: which samples ended, which were rejected (they run again), and how
    many requests each group has in the engine or held for it (a group waiting only for rewards holds no slot)."""

    def __init__(self, n_samples: int, gen_rank: int):
        self.n_samples, self.gen_rank = n_samples, gen_rank
        self.running: dict[int, Group] = {}  # granted, some episode not ended
        self.on_engine: dict[int, set[RequestId]] = {}  # group -> its requests in the engine or held for it

    def grant(self, group_id: int, problem: Problem, now: float) -> list[SampleId]:
        """A granted prompt becomes a group; the keys of the n episodes to start."""
        self.running[group_id] = Group(problem, now)
        return [SampleId(group_id, s) for s in range(self.n_samples)]

    def entered(self, request_ids: list[Hashable]) -> None:
        """Requests went into the engine (or are held for it)."""
        for rid in request_ids:
            if (g := _group_of(rid)) is not None:
                self.on_engine.setdefault(g, set()).add(rid)

    def left(self, request_ids: list[Hashable]) -> None:
        """Requests came back from the engine or were taken out of it (an unknown one changes nothing)."""
        for rid in request_ids:
            g = _group_of(rid)
            if (mine := self.on_engine.get(g)) is not None:
                mine.discard(rid)
                if not mine:
                    del self.on_engine[g]

    def rejected(self, key: SampleId, ep: FinishedEpisode) -> Problem | None:
        """The workflow rejected this episode, or it failed: the problem to run it again on (None: its group was
        dropped). Raises once one sample is rejected (not failed: FailureBudget counts those) MAX_REJECTED times
        in a row."""
        g = self.running.get(key.group_id)
        if g is None:
            return None
        g.rejected_stats.append(ep.stats)
        count_rejection(g.rejected, key.sample, ep, f"prompt {g.problem.prompt_id}")
        return g.problem

    def ended(self, key: SampleId, ep: FinishedEpisode) -> tuple[list[Span], Records] | None:
        """A scored episode; once it is its group's last, the group's spans and records."""
        g = self.running.get(key.group_id)
        if g is None:
            return None  # its group was dropped by a stop
        g.episodes[key.sample] = ep
        if len(g.episodes) < self.n_samples:
            return None
        del self.running[key.group_id]
        episodes = [g.episodes[s] for s in range(self.n_samples)]
        return group_spans(g, episodes), group_records(g, key.group_id, episodes, self.gen_rank)

    def drop_all(self) -> None:
        """A stop: every running group is given up (a resume grants its prompt again)."""
        self.running.clear()
        self.on_engine.clear()


@dataclass
class ShardBuffer:
    """Scored groups waiting for a shard. A shard is due once `max_groups` wait, the oldest has waited
    `max_wait_s`, or nothing else of this generator is coming soon (waiting would only delay the trainers)."""

    max_groups: int
    max_wait_s: float
    seq: int  # the next shard's sequence number (store.next_seq at start-up)
    scored: list[Records] = field(default_factory=list)
    since: float = 0.0  # when the oldest waiting group was scored

    def add(self, records: Records, now: float) -> None:
        if not self.scored:
            self.since = now
        self.scored.append(records)

    def due(self, now: float, more_coming: bool) -> bool:
        n = len(self.scored)
        return n > 0 and (n >= self.max_groups or now - self.since >= self.max_wait_s or not more_coming)

    def take(self) -> Shard:
        """The waiting groups as one shard: its trajectories, its episode table, each group's entry with its
        indices in the shard, and the shard's sequence number."""
        trajs, table, summaries = [], [], []
        for group, counts, summary in self.scored:
            summary["indices"] = list(range(len(trajs), len(trajs) + len(group)))
            trajs += group
            table += counts
            summaries.append(summary)
        self.scored, seq = [], self.seq
        self.seq += 1
        return trajs, table, summaries, seq


class GeneratorCore:
    """The state machine a generator's loop drives: what to ask for, what to hold back from the engine during a
    weight load, which group an episode completes, and when scored groups make a shard."""

    def __init__(self, admission: Admission, book: GroupBook, shards: ShardBuffer):
        self.admission, self.book, self.shards = admission, book, shards
        self.held: list[GenRequest] = []  # requests made while admission is stopped for a weight load
        self.stopping = False

    def want(self, engine_sequences: int, ready: bool) -> int:
        """Prompts to ask for now; `ready`: weights are loaded and the engine admits requests."""
        if not ready or self.stopping:
            return 0
        return self.admission.ask(engine_sequences + len(self.held), len(self.book.on_engine))

    def grant(self, prompts: list[tuple[int, Problem]], now: float) -> list[tuple[SampleId, Problem]]:
        """Granted (group id, problem) pairs; every episode to start, with its problem."""
        self.admission.granted(len(prompts))
        return [(key, p) for gid, p in prompts for key in self.book.grant(gid, p, now)]

    def submit(self, reqs: list[GenRequest], admitting: bool) -> list[GenRequest]:
        """New requests: those to add to the engine now (none while admission waits for a weight load)."""
        self.book.entered([r.request_id for r in reqs])
        if admitting:
            return reqs
        self.held += reqs
        return []

    def release(self) -> list[GenRequest]:
        """The requests held during a weight load, for the engine now that it is done."""
        out, self.held = self.held, []
        return out

    def returned(self, request_id: Hashable) -> None:
        """A request's output came back from the engine."""
        self.book.left([request_id])

    def left(self, request_ids: list[Hashable]) -> None:
        """Cancelled requests left the engine, or what was held for it."""
        gone = set(request_ids)
        self.book.left(list(gone))
        self.held = [r for r in self.held if r.request_id not in gone]

    def stop(self) -> None:
        self.stopping = True
        self.book.drop_all()

    def flush(self, now: float) -> Shard | None:
        """A shard of the scored groups if one is due, else None."""
        # a stop drops every running group: nothing more is coming, so what is scored goes at once
        return self.shards.take() if self.shards.due(now, more_coming=bool(self.book.running)) else None

    @property
    def done(self) -> bool:
        """Stopped, with nothing scored left to write."""
        return self.stopping and not self.shards.scored
