"""A generator's held-out evaluations: asked for by rank 0, run one at a time as episodes in the same stream."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_hpc.data import Problem
from areal_hpc.types import EvalId
from areal_hpc.workflow import EpisodeRunner, FinishedEpisode


@dataclass
class _Eval:
    tag: str
    version: int  # the weights it started on; a weight load meanwhile resumes it under the newer ones
    t_start: float
    rewards: dict[int, float] = field(default_factory=dict)  # held-out index * k + sample -> episode reward
    newest: int = -1  # the newest version that sampled any of its tokens
    tool_users: int = 0  # episodes that called a tool
    reward_failures: list[int] = field(default_factory=lambda: [0, 0])  # reward calls timed out, raised


_NO_FAILURES = {"reward_timeouts": 0, "reward_errors": 0}


class HeldoutEvals:
    """Episodes of the configured workflow on the held-out prompts, k per prompt (logging.eval_n_samples), greedy
    or at the engine's temperature. `report(body)` sends an EVAL_RESULT body; `span(t0, t1)` logs the timeline's."""

    def __init__(self, problems: list[Problem], runner: EpisodeRunner, k: int, greedy: bool, report, span):
        self.problems, self.runner, self.k, self.greedy = problems, runner, k, greedy
        self.report: Callable[[dict], None] = report
        self.span: Callable[[float, float], None] = span
        self.asked: list[str] = []  # tags asked for, not started
        self.current: _Eval | None = None

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self.asked)

    @property
    def measuring_init(self) -> bool:
        """ "init" measures the model folder itself: no weights may load before it ends."""
        return self.current is not None and self.current.tag == "init"

    def start_next(self, version: int) -> None:
        """The next evaluation asked for, if none runs, on the weights `version` loaded now."""
        if self.current is not None or not self.asked:
            return
        tag = self.asked.pop(0)
        while tag.startswith("v") and self.asked:
            # asked faster than they run: a later evaluation supersedes a periodic one
            self.report(
                {"tag": tag, "version": None, "version_end": None, "acc": None, "tool_share": None} | _NO_FAILURES
            )
            tag = self.asked.pop(0)
        if not self.problems:
            nan = float("nan")
            body = {"tag": tag, "version": version, "version_end": version, "acc": nan, "tool_share": nan}
            self.report(body | _NO_FAILURES)
            return
        self.current = _Eval(tag, version, time.time())
        for i, p in enumerate(self.problems):
            for s in range(self.k):
                self.runner.start(str(EvalId(i * self.k + s)), p.row, p.prompt_ids, greedy=self.greedy)

    def episode_done(self, index: int, ep: FinishedEpisode) -> None:
        """A held-out episode's reward (a rejected one scores 0); the result goes to rank 0 once all are in."""
        ev = self.current
        ev.rewards[index] = ep.reward or 0.0
        ev.tool_users += ep.stats.tool_calls > 0
        ev.reward_failures[0] += ep.stats.reward_timeouts
        ev.reward_failures[1] += ep.stats.reward_errors
        # a segment's versions only grow: its last token carries the newest weights it saw
        ev.newest = max([ev.newest] + [seg.versions[-1] for seg in ep.sampled if seg.versions])
        total = len(self.problems) * self.k
        if len(ev.rewards) < total:
            return
        self.current = None
        self.span(ev.t_start, time.time())
        body = {"tag": ev.tag, "version": ev.version, "version_end": max(ev.newest, ev.version)}
        failures = {"reward_timeouts": ev.reward_failures[0], "reward_errors": ev.reward_failures[1]}
        self.report(body | {"acc": sum(ev.rewards.values()) / total, "tool_share": ev.tool_users / total} | failures)
