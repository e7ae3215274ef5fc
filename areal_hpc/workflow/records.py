"""The records an episode deals in: completions, tool results, transcript segments, its counts and its end."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, make_dataclass

from areal_hpc import count_schema


@dataclass
class Completion:
    """One answer the model sampled, exactly as the engine returned it (appended to the transcript, trained)."""

    ids: list[int]
    logprobs: list[float]  # behaviour logprob of each token
    versions: list[int]  # the weight version that sampled each token
    finish_reason: str  # stop (EOS or a stop string) | length
    text: str  # ids decoded (special tokens skipped): for rewards and parsing, never tokenized again


@dataclass
class ToolResult:
    """A tool call's outcome; `text` is what goes back to the model."""

    text: str
    ok: bool  # exited 0 within its time limit
    timed_out: bool
    seconds: float


@dataclass
class Segment:
    """A run of transcript tokens: sampled by the policy (trained), or added by the workflow (not trained)."""

    ids: list[int]
    trained: bool
    logprobs: list[float] = field(default_factory=list)  # sampled segments: behaviour logprobs
    versions: list[int] = field(default_factory=list)  # sampled segments: weight versions

    @property
    def sampled(self) -> bool:
        """The model sampled it (trained, or generated with train=False): it carries logprobs and versions."""
        return self.trained or bool(self.versions)


@dataclass(frozen=True)
class EpisodeFailure:
    """Why an episode failed: its workflow or agent raised, ran out of time or gave back something unusable. A
    failed episode keeps no tokens and runs again; failures are counted against workflow.max_failure_share."""

    kind: str  # one of FAILURE_KINDS
    what: str  # "RuntimeError: the tool is down", or what came back
    where: str = ""  # the user's file:line that raised ("" when unknown: a command agent, a time-out)
    source: str = "workflow"  # workflow.fn's code, or the agent (workflow.agent / agent_command)

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"the {self.source} {self.kind}: {self.what}{at}"


FAILURE_KINDS = ("raised", "timed out", "bad result")


# an episode's counts, one field per count of the schema (count_schema.COUNTS: turns, tool calls, ...), from 0
EpisodeCountFields = make_dataclass(
    "EpisodeCountFields", count_schema.record_fields(), namespace={"__module__": __name__}
)


@dataclass
class EpisodeStats(EpisodeCountFields):
    """What an episode did: its counts (EpisodeCountFields), and what it logged along the way."""

    failure_kinds: dict[str, int] = field(default_factory=dict)  # those failures by kind (FAILURE_KINDS)
    reward_span: tuple[float, float] | None = None  # first reward call to the last answer (the timeline's span)
    tool_spans: list[tuple[float, float]] = field(default_factory=list)  # each tool call's start and end
    # numbers to average per version: reward/<key> (a reward's extras: the last call's that returned them) and
    # episode/<name> (ep.log)
    logged: dict[str, float] = field(default_factory=dict)

    def add_failures(self, other: EpisodeStats) -> None:
        """Count a rejected try's failures on the episode that ran in its place (its other counts do not carry)."""
        for name in count_schema.FAILURES:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for kind, n in other.failure_kinds.items():
            self.failure_kinds[kind] = self.failure_kinds.get(kind, 0) + n

    def add_failure(self, failure: EpisodeFailure) -> None:
        self.agent_failures += 1
        self.failure_kinds[failure.kind] = self.failure_kinds.get(failure.kind, 0) + 1

    def add_reward_call(self, status: str, extras: dict[str, float], t_start: float, t_end: float) -> None:
        """A reward call that ended as `status` (ok, timeout, error), with the extras its function returned."""
        self.reward_timeouts += status == "timeout"
        self.reward_errors += status == "error"
        self.logged.update((f"reward/{k}", v) for k, v in extras.items())
        self.reward_span = (self.reward_span[0] if self.reward_span else t_start, t_end)

    def add_tool_call(self, result: ToolResult, t_start: float, t_end: float) -> None:
        self.tool_calls += 1
        self.tool_errors += not result.ok
        self.tool_s += result.seconds
        self.tool_spans.append((t_start, t_end))


@dataclass
class FinishedEpisode:
    key: Hashable  # as given to EpisodeRunner.start
    reward: float | None  # None: the workflow rejected the episode, or it failed
    segments: list[Segment]  # the last transcript
    stats: EpisodeStats
    finish_reason: str  # of its last generate call
    t_start: float
    t_end: float
    branches: list[list[Segment]] = field(default_factory=list)  # earlier transcripts (Episode.branch)
    failure: EpisodeFailure | None = None  # why it failed (reward None): not a rejection

    @property
    def transcripts(self) -> list[list[Segment]]:
        """Every transcript the model sampled in (at least the last one): each becomes a trajectory."""
        sampled = [t for t in self.branches + [self.segments] if any(s.trained for s in t)]
        return sampled or [self.segments]

    @property
    def sampled(self) -> list[Segment]:
        """Every segment the model sampled, trained or not."""
        return [s for t in self.branches + [self.segments] for s in t if s.sampled]
