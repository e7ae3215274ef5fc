"""A scored batch (rewards, how each call ended, the numbers each returned beside its score) and its first failures."""

from __future__ import annotations

import concurrent.futures as cf
import logging

from areal_hpc.reward.bounds import ERROR, OK, TIMEOUT

__all__ = ["Scores", "FailureLog", "ScoringJob"]

logger = logging.getLogger("areal_hpc.reward.pool")


class Scores(list):
    """A batch's rewards in order, with how each call ended ("ok", "timeout" or "error": both scored 0.0) and
    the extras each returned (the other keys of a dict with a 'score'; empty otherwise)."""

    def __init__(self, values):
        super().__init__(values)
        self.statuses = [OK] * len(self)
        self.extras: list[dict[str, float]] = [{} for _ in range(len(self))]

    @property
    def timeouts(self) -> int:
        return self.statuses.count(TIMEOUT)

    @property
    def errors(self) -> int:
        return self.statuses.count(ERROR)


_KINDS = ("ran", "raised", "returned", "hung", "crashed", "was")


class FailureLog:
    """Logs the first failure of each kind once per pool (so once per rank): a time-out, an exception, a value
    that is not a reward, a crash; every later one is only counted."""

    def __init__(self):
        self.seen: set[tuple[str, str]] = set()

    def note(self, status: str, message: str) -> None:
        words = message.split()
        # what happened: "ran" (past its limit), "raised", "returned" (not a reward), "hung", "crashed"
        kind = (status, next((w for w in words if w in _KINDS), message))
        if kind in self.seen:
            return
        self.seen.add(kind)
        logger.warning("reward function %s (scored 0; later ones like it are only counted)", message)


class ScoringJob:
    """One submitted batch: collects its items' scores and resolves its future once the last one is in."""

    __slots__ = ("future", "completions", "references", "scores", "remaining", "failures")

    def __init__(self, completions: list[str], references: list, failures: FailureLog | None = None):
        self.future: cf.Future = cf.Future()
        self.future.set_running_or_notify_cancel()  # results are always delivered; no cancel
        self.completions = completions
        self.references = references
        self.scores = Scores([0.0] * len(completions))
        self.remaining = len(completions)
        self.failures = failures

    def put(
        self, idx: int, value: float, status: str = OK, message: str = "", extras: dict | None = None, log=True
    ) -> None:
        """One item's result; `log=False`: a failure that is not the reward function's (a discarded item)."""
        self.scores[idx] = value
        self.scores.statuses[idx] = status
        self.scores.extras[idx] = dict(extras or {})
        if status != OK and log and self.failures is not None:
            self.failures.note(status, message)
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(self.scores)
