"""Episodes that fail (a workflow or agent raised, timed out, gave back something unusable), against a budget."""

from __future__ import annotations

from collections import Counter, deque

from areal_hpc.workflow.records import EpisodeFailure


class EpisodeFailed(Exception):
    """Raised by a built-in workflow whose episode failed for a reason it has already described (the agent's)."""

    def __init__(self, failure: EpisodeFailure):
        super().__init__(str(failure))
        self.failure = failure


class EndpointLost(ConnectionError):
    """What episodes run on broke under them (the agent endpoint's process ended): not an episode's failure; the
    rank fails in one line. A lost connection, so a failure report reads it as an echo when other ranks failed."""


class TooManyFailures(RuntimeError):
    """More of the recent episodes failed than workflow.max_failure_share allows: the run stops (one line)."""


# a try's outcome besides a failure: it counted; it does not (rejected); it was cut short (a stop, a cut evaluation)
SCORED, VOID, CANCELLED = "scored", "void", "cancelled"


class FailureBudget:
    """The outcomes of the last `window` tries of episodes, in the order they started (scored or failed; a
    rejection or a cancellation is neither). Once the window is full and more than `max_share` of it failed,
    `over` holds the line to stop the run with: the commonest kind, its latest example (the exception, the
    user's file:line), the counts, and the settings. A flaky tool costs tries, which run again; a workflow or
    agent that fails nearly always ends the run instead of spinning.

    Why in the order they started: a failure often comes back at once while a success takes its turns, so the
    tries that ended lately are mostly failures (at start-up, all of them). A try's outcome joins the window
    only once every earlier try has ended, which makes the window's share the share of tries that fail. A
    cancellation empties the window for the same reason: the tries a stop cuts short are the slow ones, so the
    tries around it that did end are mostly failures."""

    def __init__(self, max_share: float, window: int):
        self.max_share, self.window = max_share, window
        self.recent: deque[EpisodeFailure | None] = deque()  # at most `window`, oldest first
        self.failed_recently = 0  # the failures in `recent`, kept as it moves (every episode's end passes here)
        self.started = 0  # tries numbered so far
        self.next = 0  # the first try whose outcome has not joined the window
        self.ended: dict[int, EpisodeFailure | str] = {}  # outcomes waiting for an earlier try to end
        self.episodes = 0  # tries scored or failed so far
        self.by_kind: Counter[str] = Counter()  # every failure so far
        self.over: str | None = None  # set once the budget is spent

    def start(self) -> int:
        """A try begins: its number, for `end`."""
        self.started += 1
        return self.started - 1

    def end(self, seq: int, outcome: EpisodeFailure | str) -> None:
        """Try `seq` ended: an EpisodeFailure, SCORED, VOID or CANCELLED."""
        if outcome not in (VOID, CANCELLED):
            self.episodes += 1
        if isinstance(outcome, EpisodeFailure):
            self.by_kind[outcome.kind] += 1
        self.ended[seq] = outcome
        while self.next in self.ended:
            done = self.ended.pop(self.next)
            self.next += 1
            if done == CANCELLED:
                self.recent.clear()
                self.failed_recently = 0
            elif done != VOID:
                self._join(done if isinstance(done, EpisodeFailure) else None)
        if (
            self.over is None
            and len(self.recent) == self.window
            and self.failed_recently > self.max_share * self.window
        ):
            self.over = self.line()

    def _join(self, outcome: EpisodeFailure | None) -> None:
        self.recent.append(outcome)
        self.failed_recently += outcome is not None
        if len(self.recent) > self.window:
            self.failed_recently -= self.recent.popleft() is not None

    def line(self) -> str:
        """Why the run stops: what failed most, as it last failed, and how often."""
        recent = [f for f in self.recent if f is not None]
        commonest = Counter(f.kind for f in recent).most_common(1)[0][0]
        latest = next(f for f in reversed(recent) if f.kind == commonest)
        kinds = ", ".join(f"{kind} {n}" for kind, n in self.by_kind.most_common())
        return (
            f"{latest}; {len(recent)} of the last {self.window} episodes failed, more than "
            f"workflow.max_failure_share={self.max_share:g} of workflow.failure_window={self.window} allows "
            f"({sum(self.by_kind.values())} failed of {self.episodes} episodes on this generator: {kinds})"
        )
