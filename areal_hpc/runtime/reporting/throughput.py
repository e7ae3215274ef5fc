"""Consumed tokens over the running time they took: for this start, and for the whole run across its starts."""

from __future__ import annotations


class Throughput:
    """Tokens trained on and the running time they took, always counted over the same span.

    This start's span runs from the publish of its starting weights to now. The run's span adds each earlier
    start's, up to the version its checkpoint kept: a version trained after that checkpoint was lost and
    trained again, so its tokens and time count once, in the start that kept it. The time between starts
    (queue waits, start-ups, final evaluations, work lost after the last checkpoint) is left out, and said
    (`gap_s`). A checkpoint from before this counter holds no earlier span: the run's figures then count
    from the start that resumed it (`starts` says how many starts they cover).
    """

    def __init__(self, state: dict | None = None):
        s = state or {}
        self.before_tokens = int(s.get("tokens", 0))  # earlier starts' tokens up to the checkpoint resumed
        self.before_s = float(s.get("rl_s", 0.0))  # and the running time they took
        self.before_starts = int(s.get("starts", 0))
        self.t_first = s.get("t_first")  # epoch seconds the first counted start published its weights
        self.tokens = 0  # this start's
        self.through: dict[int, tuple[int, float]] = {}  # version trained -> (this start's tokens, epoch) then

    def trained(self, v: int, tokens: int, now: float) -> None:
        self.tokens += tokens
        self.through[v] = (self.tokens, now)

    def state(self, upto: int, since: float) -> dict:
        """What a checkpoint of version `upto` keeps: the run's span through that version (`since`: when this
        start published its starting weights)."""
        tokens, t = self.through.get(upto, (0, since))  # the starting version: nothing trained yet
        for v in [v for v in self.through if v < upto]:  # never asked for again
            del self.through[v]
        return {
            "tokens": self.before_tokens + tokens,
            "rl_s": self.before_s + max(t - since, 0.0),
            "starts": self.before_starts + 1,
            "t_first": self.t_first if self.t_first is not None else since,
        }

    def start_rate(self, since: float, now: float) -> float:
        """This start's consumed tokens/s."""
        return self.tokens / max(now - since, 1e-9)

    def _run_span(self, since: float, now: float) -> tuple[int, float, int]:
        """The run's tokens, running seconds and starts counted; a start that trained nothing (the run was
        already at trainer.versions) adds no time."""
        if not self.through:
            return self.before_tokens, self.before_s, self.before_starts
        return self.before_tokens + self.tokens, self.before_s + now - since, self.before_starts + 1

    def run_rate(self, since: float, now: float) -> float | None:
        """The run's consumed tokens/s: every counted start's tokens over their running time (None: none yet)."""
        tokens, rl_s, _ = self._run_span(since, now)
        return tokens / rl_s if rl_s > 0 else None

    def summary(self, since: float, now: float) -> dict:
        """summary.json's figures: the run's (`consumed_tokens_per_s`) and this start's."""
        tokens, rl_s, starts = self._run_span(since, now)
        t_first = self.t_first if self.t_first is not None else since
        return {
            "consumed_tokens_per_s": tokens / rl_s if rl_s > 0 else 0.0,
            "run_tokens_counted": tokens,
            "run_rl_wall_s": rl_s,
            "starts": starts,
            "gap_s": max(now - t_first - rl_s, 0.0),
            "start_tokens_consumed": self.tokens,
            "start_consumed_tokens_per_s": self.start_rate(since, now),
        }
