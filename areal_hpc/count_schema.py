"""The one schema of an episode's counts: records, shard columns, GROUPS_DONE fields and report sums derive from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Count:
    """One number an episode counts up as it runs (EpisodeStats), and where it goes from there.

    `summed_into` says which route takes it to metrics.csv: "trained" sums it over each version's trained
    episodes, read from the shards' episode tables by the trainers; "generated" sums it over every episode
    generated since the previous row, whatever became of its group (GROUPS_DONE), and summary.json and
    progress.json over the run."""

    name: str
    dtype: str  # its shard column's dtype, explicit little-endian; a float dtype makes it a float in the records
    summed_into: str  # "trained" | "generated"
    doc: str
    stored: bool = True  # a column of the shard's episode table (a "trained" count must be one)
    # a rejected or failed try's count is added to the episode that ran in its place, and to its group's sum
    failures: bool = False
    mean: bool = False  # metrics.csv shows <name>_mean, per trained sample, instead of the sum
    per_episode: bool = False  # summary.json's <name>_per_episode, over the run's generated episodes
    unset: int = 0  # an episode table row made without counting (a single generate call, shards of schema 1)

    @property
    def sent(self) -> bool:
        """GROUPS_DONE carries the group's sum (rank 0 needs it for every generated episode)."""
        return self.summed_into == "generated" or self.per_episode

    @property
    def type(self) -> type:
        return float if np.dtype(self.dtype).kind == "f" else int


# Adding a count is one entry here (and producing its value where it arises, in EpisodeStats' methods).
COUNTS: tuple[Count, ...] = (
    Count("turns", "<i4", "trained", "generate calls", mean=True, per_episode=True, unset=1),
    Count("tool_calls", "<i4", "trained", "tool calls", per_episode=True),
    Count("tool_errors", "<i4", "trained", "tool calls that timed out or exited non-zero"),
    Count("tool_s", "<f4", "trained", "seconds spent in tool calls"),
    Count("reward_timeouts", "<i4", "generated", "reward calls past reward.timeout_s", failures=True),
    Count("reward_errors", "<i4", "generated", "reward calls that raised", failures=True),
    Count(
        "branches",
        "<i4",
        "generated",
        "transcripts given up for a rewritten history (the agent endpoint counts them)",
        stored=False,
        failures=True,
    ),
    Count(
        "agent_failures",
        "<i4",
        "generated",
        "tries whose agent or workflow failed (raised, timed out, a bad result) and ran again",
        stored=False,
        failures=True,
    ),
)


def check(counts: tuple[Count, ...]) -> None:
    """ValueError naming the first count that cannot work: a name taken, an unknown route, or a "trained" count
    the trainers cannot read (not stored)."""
    seen = {"group_id", "sample_idx", "episodes"}  # the episode table's keys; GROUPS_DONE's episode count
    for c in counts:
        if c.name in seen:
            raise ValueError(f"episode count {c.name!r}: the name is taken")
        if c.summed_into not in ("trained", "generated"):
            raise ValueError(f"episode count {c.name!r}: summed_into {c.summed_into!r}, not trained or generated")
        if c.summed_into == "trained" and not c.stored:
            raise ValueError(f"episode count {c.name!r}: summed over trained episodes, so it must be stored")
        seen.add(c.name)


check(COUNTS)

# The names each home takes, in the schema's order.
STORED = tuple(c.name for c in COUNTS if c.stored)  # the episode table's columns after group_id, sample_idx
DTYPES = {c.name: np.dtype(c.dtype) for c in COUNTS if c.stored}
UNSET = {c.name: c.unset for c in COUNTS if c.stored}
FAILURES = tuple(c.name for c in COUNTS if c.failures)
# what GROUPS_DONE carries of a group's episodes, whatever becomes of the group: how many, and these sums
SENT = tuple(c.name for c in COUNTS if c.sent)
GROUP_COUNTS = ("episodes", *SENT)
TRAINED_SUMS = tuple(c.name for c in COUNTS if c.summed_into == "trained" and not c.mean)  # metrics.csv: <name>
TRAINED_MEANS = tuple(c.name for c in COUNTS if c.summed_into == "trained" and c.mean)  # metrics.csv: <name>_mean
GENERATED = tuple(c.name for c in COUNTS if c.summed_into == "generated")  # metrics.csv and summary.json: <name>
PER_EPISODE = tuple(c.name for c in COUNTS if c.per_episode)  # summary.json: <name>_per_episode


def record_fields() -> list[tuple[str, type, object]]:
    """Every count as a dataclass field starting at 0 (make_dataclass's form): EpisodeStats' counts."""
    return [(c.name, c.type, field(default=c.type(0))) for c in COUNTS]


def table_fields() -> list[tuple[str, type, object]]:
    """The stored counts as dataclass fields at their unset value: an episode table row's counts."""
    return [(c.name, c.type, field(default=c.type(c.unset))) for c in COUNTS if c.stored]
