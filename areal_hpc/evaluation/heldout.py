"""A generator's held-out evaluations: asked for by rank 0, run one at a time as episodes in the same stream."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_hpc.data import Problem
from areal_hpc.evaluation import heldout_figures
from areal_hpc.types import EvalId
from areal_hpc.workflow import EpisodeRunner, FinishedEpisode

log = logging.getLogger("areal_hpc.generator")
PROGRESS_EVERY_S = 1.0  # how often a running evaluation tells rank 0 how far it got (the progress bar shows it)


@dataclass
class _Eval:
    tag: str
    version: int  # the weights it started on; a weight load meanwhile resumes it under the newer ones
    t_start: float
    # held-out index * k + sample -> episode reward (None: its agent or workflow failed, left out of the figures)
    rewards: dict[int, float | None] = field(default_factory=dict)
    newest: int = -1  # the newest version that sampled any of its tokens
    tool_users: int = 0  # episodes that called a tool
    reward_failures: list[int] = field(default_factory=lambda: [0, 0])  # reward calls timed out, raised
    deadline: float | None = None  # past it the unfinished episodes are cut
    bound_by: str = "logging.eval_timeout_s"  # the setting that set the deadline


_NO_FAILURES = {"reward_timeouts": 0, "reward_errors": 0, "agent_failures": 0}


class HeldoutEvals:
    """Episodes of the configured workflow on the held-out prompts, k per prompt (logging.eval_n_samples), greedy
    or at the engine's temperature. `report(body)` sends an EVAL_RESULT body; `span(t0, t1)` logs the timeline's."""

    def __init__(
        self, problems: list[Problem], runner: EpisodeRunner, k: int, greedy: bool, report, span, threshold=1.0
    ):
        self.problems, self.runner, self.k, self.greedy = problems, runner, k, greedy
        self.threshold = threshold  # logging.eval_threshold: the reward at which an episode counts as correct
        self.report: Callable[[dict], None] = report
        self.span: Callable[[float, float], None] = span
        self.asked: list[str] = []  # tags asked for, not started
        self.current: _Eval | None = None
        self.timeout_s = 0.0  # logging.eval_timeout_s (0: no bound)
        self.final_s: float | None = None  # a stop request's bound on the final evaluation (logging.stop_eval_s)
        # out of the runner only, until bound() gives the generator's, which also interrupts them in the engine
        self.drop: Callable[[list[EvalId]], None] = runner.cancel
        self.progress: Callable[[dict], None] = lambda body: None  # an EVAL_PROGRESS body to rank 0
        self._progress_t = 0.0

    def bound(self, timeout_s: float, drop, progress) -> None:
        """Each evaluation ends after timeout_s (0: never) with what it has; drop(keys) cancels episodes;
        progress(body) sends rank 0 how far the running one got, every PROGRESS_EVERY_S."""
        self.timeout_s, self.drop, self.progress = timeout_s, drop, progress

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
            self._not_run(tag)
            tag = self.asked.pop(0)
        if not self.problems:
            nan = float("nan")
            body = {"tag": tag, "version": version, "version_end": version, "acc": nan, "reward_mean": nan}
            body["tool_share"] = nan
            self.report(body | _NO_FAILURES | {"cut": 0})
            return
        now = time.time()
        self.current = _Eval(tag, version, now, deadline=now + self.timeout_s if self.timeout_s else None)
        if tag == "final" and self.final_s is not None:
            self._stop_bound(self.current)
        for i, p in enumerate(self.problems):
            for s in range(self.k):
                self.runner.start(EvalId(i * self.k + s), p.row, p.prompt_ids, greedy=self.greedy)

    def _not_run(self, tag: str) -> None:
        """An evaluation asked for and never started (superseded by a later one, or a stop): rank 0 hears so."""
        none = {"acc": None, "reward_mean": None, "tool_share": None, "cut": 0}
        self.report({"tag": tag, "version": None, "version_end": None} | none | _NO_FAILURES)

    def episode_done(self, index: int, ep: FinishedEpisode) -> None:
        """A held-out episode's reward (a rejected one scores 0, a failed one is left out); the result goes to rank
        0 once all are in."""
        ev = self.current
        if ev is None or ep.t_start < ev.t_start:
            return  # an episode of an evaluation that was cut, finished as it was cancelled
        # a failed agent (a flaky tool) says nothing of the model: counted, and left out as a cut episode is
        ev.rewards[index] = None if ep.failure is not None else ep.reward or 0.0
        ev.tool_users += ep.stats.tool_calls > 0
        ev.reward_failures[0] += ep.stats.reward_timeouts
        ev.reward_failures[1] += ep.stats.reward_errors
        # a segment's versions only grow: its last token carries the newest weights it saw
        ev.newest = max([ev.newest] + [seg.versions[-1] for seg in ep.sampled if seg.versions])
        if len(ev.rewards) == len(self.problems) * self.k:
            self._finish()

    def _finish(self) -> None:
        """The running evaluation's result to rank 0: its figures over the episodes that finished and did not fail,
        how many failed and how many were cut (neither scored as wrong answers)."""
        ev, total = self.current, len(self.problems) * self.k
        self.current = None
        self.span(ev.t_start, time.time())
        body = {"tag": ev.tag, "version": ev.version, "version_end": max(ev.newest, ev.version)}
        failures = {"reward_timeouts": ev.reward_failures[0], "reward_errors": ev.reward_failures[1]}
        scored = [r for r in ev.rewards.values() if r is not None]
        failures["agent_failures"] = len(ev.rewards) - len(scored)
        figures = heldout_figures(scored, self.threshold)
        scores = {"acc": figures["heldout_acc"], "reward_mean": figures["heldout_reward_mean"]}
        done = len(ev.rewards)
        tools = {"tool_share": ev.tool_users / done if done else float("nan")}  # failed ones' tool calls count
        self.report(body | scores | tools | failures | {"cut": total - done})

    def cut(self, why: str) -> None:
        """End the running evaluation now: its unfinished episodes are cancelled and counted as cut."""
        ev, total = self.current, len(self.problems) * self.k
        keys = [EvalId(i) for i in range(total) if i not in ev.rewards]
        self.drop(keys)
        log.warning(
            "held-out evaluation %s cut after %.0f s (%s): %d of %d episodes finished, %d cut and left out of it",
            ev.tag,
            time.time() - ev.t_start,
            why,
            len(ev.rewards),
            total,
            len(keys),
        )
        self._finish()

    def tick(self, now: float) -> None:
        """From the generator's loop: cut the running evaluation past its deadline; else report its progress."""
        ev = self.current
        if ev is None:
            return
        if ev.deadline is not None and now >= ev.deadline:
            self.cut(f"{ev.bound_by} reached")
        elif now - self._progress_t >= PROGRESS_EVERY_S:
            self._progress_t = now
            done, total = len(ev.rewards), len(self.problems) * self.k
            self.progress({"tag": ev.tag, "done": done, "total": total, "reward_timeouts": ev.reward_failures[0]})

    def _stop_bound(self, ev: _Eval) -> None:
        """The final evaluation of a run stopping on request ends by logging.stop_eval_s, if that comes first."""
        if ev.deadline is None or ev.t_start + self.final_s < ev.deadline:
            ev.deadline, ev.bound_by = ev.t_start + self.final_s, "logging.stop_eval_s"

    def stop(self, final_s: float | None) -> None:
        """Rank 0's STOP. On a stop request (final_s: logging.stop_eval_s) the evaluation running now is cut
        unless it is the final one, those asked and not started are not run, and the final gets final_s at
        most; on a normal end (None) they all run as asked."""
        if final_s is None:
            return
        self.final_s = final_s
        ev = self.current
        if ev is not None and ev.tag != "final":
            self.cut("the run is stopping")
        elif ev is not None:
            self._stop_bound(ev)
        for tag in [t for t in self.asked if t != "final"]:
            self._not_run(tag)
        self.asked = [t for t in self.asked if t == "final"]
