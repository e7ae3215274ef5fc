"""Automatic restarts inside an allocation: why a world died, and the run directory's record of restarts."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from areal_hpc.rundir import RunDir
from areal_hpc.runtime.liveness import silence_verdict
from areal_hpc.utils import atomic_write_text

# srun's line for a task that died ("srun: error: n2: task 0: Killed"); Killed/Terminated: by a signal
_SRUN_DEATH = re.compile(
    r"error: (\S+): tasks? ([\d,-]+): (Killed|Terminated|Exited with exit code \d+|.*fault|Aborted)"
)


def death_cause(run_dir: Path, code: int, since: float, job_output: Path | None = None, watchdog: str = "") -> str:
    """One line: why the world that started at `since` ended with `code`, from the rank error files
    written since then and this world's part of the job output (srun's lines on its tasks, in order).

    In order of preference:
    1. rank 0's verdict on a silent rank. srun then kills the stopped rank, and its "Killed" line, which
       can come first, is a consequence; so is the watchdog's line when rank 0 then hangs in MPI_Abort.
    2. `watchdog`, the job script's line on rank 0's quiet heartbeat, or a rank's own error line, which
       says more; unless srun reported a task's death before it: a world being torn down writes no
       heartbeat either.
    3. a task killed by a signal (srun's first such line: its peers' errors, such as a failed
       broadcast, follow from it);
    4. the first rank error written, then srun's first line on a task, then the code.
    """
    errors = RunDir(run_dir).rank_error_lines(since)
    if silent := silence_verdict(errors):
        return silent
    first_error = errors[0] if errors else ""
    lines = []
    if job_output is not None and job_output.is_file():
        lines = job_output.read_text(errors="replace").splitlines()
        starts = [i for i, ln in enumerate(lines) if ln.startswith("[areal]") and " starting on " in ln]
        lines = lines[starts[-1] if starts else 0 :]
    deaths = [(i, m) for i, ln in enumerate(lines) if (m := _SRUN_DEATH.search(ln))]
    if watchdog:
        said_at = next((i for i, ln in enumerate(lines) if watchdog in ln), len(lines))
        if not deaths or deaths[0][0] > said_at:
            return first_error or watchdog
    if deaths and deaths[0][1].group(3) in ("Killed", "Terminated"):
        m = deaths[0][1]
        return f"a task was killed by a signal: srun says {m.group(1)}: task {m.group(2)}: {m.group(3)} (code {code})"
    if first_error:
        return first_error
    if deaths:
        m = deaths[0][1]
        return f"srun exited with code {code}: {m.group(1)}: task {m.group(2)}: {m.group(3)}"
    return f"srun exited with code {code}"


def load_restarts(run_dir: Path) -> list[dict]:
    path = RunDir(run_dir).restarts
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def record_restart(run_dir: Path, attempt: int, code: int, since: float, watchdog: str = "", job_output=None) -> dict:
    """Append one restart to RUN_DIR/restarts.json (rewritten atomically) and return it."""
    entry = {
        "attempt": attempt,
        "time": time.time(),
        "world_started": since,
        "exit_code": code,
        "cause": death_cause(run_dir, code, since, Path(job_output) if job_output else None, watchdog),
        "checkpoint": RunDir(run_dir).latest_checkpoint(),
    }
    atomic_write_text(RunDir(run_dir).restarts, json.dumps(load_restarts(run_dir) + [entry], indent=1))
    return entry


def _resumed_from(entry: dict) -> str:
    """A world that died before its first checkpoint starts the run again from the beginning."""
    return "from the start" if entry["checkpoint"] is None else f"from checkpoint v{entry['checkpoint']}"


def restarts_line(run_dir: Path) -> str | None:
    """`areal-hpc status`'s line on restarts, None when there were none."""
    rs = load_restarts(run_dir)
    if not rs:
        return None
    last = rs[-1]
    when = time.strftime("%H:%M:%S", time.localtime(last["time"]))
    return f"restarts: {len(rs)} (last at {when}, {_resumed_from(last)}: {last['cause']})"


def main(argv: list[str]) -> int:
    """The job script's call after a world died: `python -m areal_hpc.launch.restarts RUN_DIR ATTEMPT CODE
    SINCE [WATCHDOG_LINE]`; prints the restart's one line. Exit code 2: do not restart (the run
    directory cannot be written)."""
    run_dir, attempt, code, since = Path(argv[0]), int(argv[1]), int(argv[2]), float(argv[3])
    if problem := RunDir(run_dir).storage_problem():
        print(f"not restarting: {problem}")  # a new world would die the same way
        return 2
    watchdog = argv[4] if len(argv) > 4 else ""
    job = RunDir(run_dir).slurm_output.replace("%j", os.environ.get("SLURM_JOB_ID", ""))
    entry = record_restart(run_dir, attempt, code, since, watchdog, job)
    print(f"restart {attempt} {_resumed_from(entry)}: {entry['cause']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
