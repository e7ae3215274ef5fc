"""Automatic restarts inside an allocation: why a world died, and the run directory's record of restarts."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from areal_hpc.launch.environment import slurm_job_id
from areal_hpc.rundir import RunDir
from areal_hpc.rundir.actions import storage_problem
from areal_hpc.runtime.comm.liveness import silence_verdict
from areal_hpc.runtime.failures import PEER, STARTUP, read_failures
from areal_hpc.utils import atomic_write_text

# srun's line for a task that died ("srun: error: n2: task 0: Killed"); Killed/Terminated: by a signal
_SRUN_DEATH = re.compile(
    r"error: (\S+): tasks? ([\d,-]+): (Killed|Terminated|Exited with exit code \d+|.*fault|Aborted)"
)


def death_cause(
    run_dir: Path, code: int | None, since: float, job_output: Path | None = None, watchdog: str = ""
) -> str:
    """One line: why the world that started at `since` ended with `code`, from the rank error files
    written since then and this world's part of the job output (srun's lines on its tasks, in order).
    In order of preference:
    1. rank 0's verdict on a silent rank. srun then kills the stopped rank, and its "Killed" line, which
       can come first, is a consequence; so is the watchdog's line when rank 0 then hangs in MPI_Abort.
    2. `watchdog`, the job script's line on rank 0's quiet heartbeat, unless srun reported a task's death
       before it (a world being torn down writes no heartbeat either); a rank's own error line says more.
    3. a rank's own error (runtime/failures.py: not a lost peer's echo), such as a checkpoint that does not
       load: the rank aborts the world, so srun's lines on the tasks it kills are consequences.
    4. a task killed by a signal (srun's first such line: its peers' errors, such as a failed
       broadcast, follow from it);
    5. the first rank error written, then srun's first line on a task, then the code.
    """
    return _cause(run_dir, code, since, job_output, watchdog)[0]


def _cause(run_dir: Path, code: int | None, since: float, job_output: Path | None, watchdog: str) -> tuple[str, bool]:
    """death_cause's line, and whether it is a start-up error that a new world would repeat."""
    failures = read_failures(run_dir, since)
    if silent := silence_verdict([f.line for f in failures]):
        return silent, False
    own = next((f for f in failures if f.kind != PEER), None)
    first_error = failures[0].line if failures else ""
    lines = []
    if job_output is not None and job_output.is_file():
        lines = job_output.read_text(errors="replace").splitlines()
        starts = [i for i, ln in enumerate(lines) if ln.startswith("[areal]") and " starting on " in ln]
        lines = lines[starts[-1] if starts else 0 :]
    deaths = [(i, m) for i, ln in enumerate(lines) if (m := _SRUN_DEATH.search(ln))]
    with_code = "" if code is None else f" (code {code})"
    if watchdog and own is None:
        said_at = next((i for i, ln in enumerate(lines) if watchdog in ln), len(lines))
        if not deaths or deaths[0][0] > said_at:
            return first_error or watchdog, False
    if own is not None:
        return own.line, own.kind == STARTUP
    if deaths and deaths[0][1].group(3) in ("Killed", "Terminated"):
        m = deaths[0][1]
        return (
            f"a task was killed by a signal: srun says {m.group(1)}: task {m.group(2)}: {m.group(3)}{with_code}",
            False,
        )
    if first_error:
        return first_error, False
    exited = "srun failed" if code is None else f"srun exited with code {code}"
    if deaths:
        m = deaths[0][1]
        return f"{exited}: {m.group(1)}: task {m.group(2)}: {m.group(3)}", False
    return exited, False


def load_restarts(run_dir: Path) -> list[dict]:
    path = RunDir(run_dir).restarts
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def record_restart(run_dir: Path, attempt: int, code: int, since: float, cause: str, restarted: bool = True) -> dict:
    """Append one world's death to RUN_DIR/restarts.json (rewritten atomically) and return it: restarted, or
    not (a start-up error that would repeat, past slurm.max_restarts, a run directory that cannot be written)."""
    entry = {
        "job_id": slurm_job_id(),  # status shows the restarts of the job it reports on
        "restarted": restarted,
        "attempt": attempt,
        "time": time.time(),
        "world_started": since,
        "exit_code": code,
        "cause": cause,
        "checkpoint": RunDir(run_dir).latest_checkpoint(),
    }
    atomic_write_text(RunDir(run_dir).restarts, json.dumps(load_restarts(run_dir) + [entry], indent=1))
    return entry


def _resumed_from(entry: dict) -> str:
    """A world that died before its first checkpoint starts the run again from the beginning."""
    return "from the start" if entry["checkpoint"] is None else f"from checkpoint v{entry['checkpoint']}"


def restarts_line(run_dir: Path, job_id: str | None = None) -> str | None:
    """`areal-hpc status`'s line on the restarts of job `job_id` (all of them: None), None when there were none."""
    rs = [r for r in load_restarts(run_dir) if job_id is None or r.get("job_id") in (None, job_id)]
    rs = [r for r in rs if r.get("restarted", True)]  # a death without a restart is status' error line
    if not rs:
        return None
    last = rs[-1]
    when = time.strftime("%H:%M:%S", time.localtime(last["time"]))
    return f"restarts: {len(rs)} (last at {when}, {_resumed_from(last)}: {last['cause']})"


# the job's own last word: why it restarts no more, or why a start never began (prepare's refusal, as click
# prints it; the claim's refusal)
_GAVE_UP = re.compile(
    r"^(?:\[areal\] [\d:]+ ((?:not restarting|giving up): .*)|Error: (.*)|\[areal\] (job \S+ refused .*))$"
)


def error_line(run_dir: Path, job_id: str | None, since: float = 0.0) -> str | None:
    """`areal-hpc status`'s error line: why the latest world of the start that began at `since` died, from its
    rank error files (they stay until the next world starts) and its part of the job output; else the job's
    own last word when it gave up. An earlier job's error files, left until this job's first world, are not
    this start's (5 s of slack: the file server's clock)."""
    out = RunDir(run_dir).slurm_output_of(job_id) if job_id else None
    if read_failures(run_dir, since - 5):
        return _cause(run_dir, None, since - 5, out, "")[0]
    if out is None or not out.is_file():
        return None
    said = [
        next(filter(None, m.groups()))
        for ln in out.read_text(errors="replace").splitlines()
        if (m := _GAVE_UP.match(ln))
    ]
    return said[-1] if said else None


def main(argv: list[str]) -> int:
    """The job script's call after a world died: `python -m areal_hpc.launch.restarts RUN_DIR ATTEMPT CODE
    SINCE [WATCHDOG_LINE [MAX_RESTARTS]]`; prints one line: the restart, or why there is none. Exit code 2: do
    not restart (the run directory cannot be written, a start-up error that would repeat, or ATTEMPT is past
    MAX_RESTARTS); the line then carries the cause, for the job's output."""
    run_dir, attempt, code, since = Path(argv[0]), int(argv[1]), int(argv[2]), float(argv[3])
    watchdog = argv[4] if len(argv) > 4 else ""
    max_restarts = int(argv[5]) if len(argv) > 5 else None
    run = RunDir(run_dir)
    if problem := storage_problem(run):
        print(f"not restarting: {problem}")  # a new world would die the same way (and restarts.json cannot be written)
        return 2
    # the error files are this world's (each world's start clears them): a minute of slack for the file server's clock
    cause, repeats = _cause(
        run_dir, code, since - 60, run.slurm_output_of(os.environ.get("SLURM_JOB_ID", "")), watchdog
    )
    if repeats or (max_restarts is not None and attempt > max_restarts):
        record_restart(run_dir, attempt, code, since, cause, restarted=False)
        if repeats:
            print(f"not restarting: {cause}: it would fail the same way")
        else:
            times = "once" if attempt == 1 else f"{attempt} times"
            print(f"giving up: the world died {times} (slurm.max_restarts={max_restarts}); the last time: {cause}")
        return 2
    entry = record_restart(run_dir, attempt, code, since, cause)
    print(f"restart {attempt} {_resumed_from(entry)}: {entry['cause']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
