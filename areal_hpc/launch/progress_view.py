"""Progress as one line: `areal-hpc status`'s (this start's figures only, whatever progress.json holds), and the
launcher's every few seconds when its output is not a terminal."""

from __future__ import annotations

import math
from pathlib import Path

from areal_hpc.launch.jobs import ACTIVE, NOT_STARTED, start_began
from areal_hpc.launch.restarts import load_restarts
from areal_hpc.rundir import RunDir
from areal_hpc.utils import PIPED_PROGRESS_S


def this_start_began(run_dir: Path, job_id: str, state: str) -> float:
    """When the start status speaks of began: the job's start, or its latest in-job restart (restarts.json);
    inf while it is still to come, 0 when Slurm does not say (progress.json is then taken as this start's)."""
    if state in NOT_STARTED:
        return math.inf
    began = start_began(job_id)
    if began is None:
        return 0.0
    # a restart began a new world; a death without one (restarted: false) began nothing
    restarts = [r.get("time", 0.0) for r in load_restarts(run_dir) if isinstance(r, dict) and r.get("restarted", True)]
    return max([began, *[t for t in restarts if isinstance(t, (int, float))]])


def _num(x, spec: str) -> str:
    try:
        return format(float(x), spec)
    except (TypeError, ValueError):
        return "n/a"


def progress_line(run: RunDir, p: dict | None, began: float, state: str) -> str:
    """One line on the run's progress in the start that began at `began` (job state `state`)."""
    if p is not None and not isinstance(p, dict):
        p = None
    if p is not None and _time(p) >= began:
        return _current(p)
    ckpt = run.latest_checkpoint()
    resumed = f"resumed from v{ckpt}" if ckpt is not None else "from the beginning"
    if p is None and ckpt is None:
        return "progress: none yet (the run has not published its first version)"
    if state in NOT_STARTED:
        return f"progress: not started yet ({resumed.replace('resumed', 'resumes')})"
    if state in ACTIVE:  # running, configuring, suspended: this start is under way
        return f"progress: starting ({resumed})"
    return f"progress: this start wrote none: it ended before its first version ({resumed})"


def _time(p: dict) -> float:
    """When progress.json was written; unsaid, it counts as this start's unless a start is still to come."""
    try:
        return float(p.get("time"))
    except (TypeError, ValueError):
        return math.nextafter(math.inf, 0)


def _current(p: dict) -> str:
    acc = "n/a" if p.get("heldout_acc") is None else _num(p["heldout_acc"], ".1%")
    if acc != "n/a" and isinstance(p.get("heldout_version"), int):
        acc += f" (v{p['heldout_version']})"
    tps = f"{_num(p.get('consumed_tokens_per_s'), '.0f')} consumed tokens/s"
    resumed = isinstance(p.get("start_version"), int) and p["start_version"] > 0
    if resumed and p.get("run_consumed_tokens_per_s") is not None:
        if p.get("version") == p.get("start_version"):  # this start trained nothing: the run's figure alone
            tps = f"{_num(p['run_consumed_tokens_per_s'], '.0f')} consumed tokens/s over the run"
        else:
            tps += f" this start, {_num(p['run_consumed_tokens_per_s'], '.0f')} over the run"
    said = p.get("state", "?")
    short = isinstance(p.get("version"), int) and isinstance(p.get("versions"), int) and p["version"] < p["versions"]
    if said == "finished" and short:  # rank 0 ended this start early: cancelled, preempted, out of time, failed
        said = "stopped"
    return (
        f"progress: version {p.get('version', '?')}/{p.get('versions', '?')} ({said}), "
        f"reward {_num(p.get('reward_mean'), '.3f')}, held-out {acc}, {tps}, "
        f"{_num(p.get('elapsed_s'), '.0f')} s since start"
    )


def progress_lines(run_dir: Path, state: str, began: float) -> list[str]:
    """status's lines on progress: this start's warning and progress line, or what this start is doing yet."""
    run = RunDir(run_dir)
    p = run.read_progress()
    try:
        current = isinstance(p, dict) and _time(p) >= began
        warning = [f"warning: {p['warning']}"] if current and p.get("warning") else []
        return [*warning, progress_line(run, p, began, state)]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:  # never a traceback: one line
        return [f"progress: {run.progress} could not be shown ({type(err).__name__}: {err})"]


class ProgressLines:
    """The launcher's progress where a bar would spam (a Slurm job's log, `> file`): a plain line at the first
    progress, then at most one per `interval_s`, and none while progress.json is unchanged."""

    def __init__(self, interval_s: float = PIPED_PROGRESS_S):
        self.interval_s = interval_s
        self.shown: dict | None = None  # the progress the latest line showed
        self.shown_at: float | None = None

    def line(self, now: float, p: dict | None) -> str | None:
        """The line to print at `now` for the latest progress `p`, or None."""
        if not isinstance(p, dict) or p == self.shown:
            return None
        if self.shown_at is not None and now - self.shown_at < self.interval_s:
            return None
        self.shown, self.shown_at = p, now
        return piped_line(p)

    def final(self, p: dict | None) -> str | None:
        """The run ended: its last progress, unless the latest line showed it already."""
        if not isinstance(p, dict) or p == self.shown:
            return None
        self.shown = p
        return piped_line(p)


def piped_line(p: dict) -> str:
    """status's line, plus what the bar shows beside it: reward failures and a held-out evaluation under way."""
    extra = [f"{n} {what}" for what, n in reward_failures(p).items()]
    if isinstance(ev := p.get("eval"), dict):
        extra.append(f"evaluating {ev.get('tag')}: {ev.get('done')}/{ev.get('total')} episodes")
    return "; ".join([_current(p), *extra])


def reward_failures(progress: dict) -> dict[str, str]:
    """The progress bar's reward errors and time-outs, and agent (or workflow) failures, training and held-out
    episodes together, once there are any."""
    out = {}
    counts = ("reward errors", "reward_errors"), ("reward time-outs", "reward_timeouts"), ("failed", "agent_failures")
    for what, key in counts:
        n = (progress.get(key) or 0) + (progress.get(f"heldout_{key}") or 0)
        if n:
            out[what] = str(n)
    return out
