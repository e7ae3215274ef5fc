"""A run's Slurm jobs: the claim a job takes at start-up (one per run directory), every job of a run (status,
cancel), and where a job is in its life."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from areal_hpc.launch.slurm import SlurmError, job_state, load_job, pending_reason, queued_jobs, slurm_command
from areal_hpc.rundir import RunDir

# a job in one of these states holds its run: it runs now or will (a requeued job comes back PENDING)
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "CONFIGURING", "COMPLETING", "RESIZING", "REQUEUE_HOLD"}
NOT_STARTED = {"PENDING", "REQUEUED", "REQUEUE_HOLD"}  # a start is still to come: progress.json is an earlier one's


def start_began(job_id: str) -> float | None:
    """Epoch seconds the job's current start began (sacct's Start: a requeued job's latest), None if unknown."""
    try:
        out = slurm_command(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,Start"])
    except SlurmError:
        return None
    starts = []
    for line in out.splitlines():
        try:
            starts.append(datetime.fromisoformat(line.split("|")[1].strip()).timestamp())
        except (IndexError, ValueError):  # "Unknown", "None": not started
            pass
    return min(starts) if starts else None  # the het job's components start together


def _owner(path: Path) -> str | None:
    """The job id a claim file names; '' for an unreadable one (no job owns it), None if it is gone."""
    try:
        return str(json.loads(path.read_text()).get("job_id", ""))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        return ""


def claim_owner(run_dir: os.PathLike | str) -> str | None:
    """The job id in RUN_DIR's claim (None when no job claimed the run, or its claim is unreadable)."""
    return _owner(RunDir(run_dir).job_claim) or None


def take_claim(run_dir: os.PathLike | str, job_id: str) -> str | None:
    """Claim the run in RUN_DIR for `job_id`: None when it is this job's now (taken, or its own from before a
    requeue or restart); else one line naming the active job that owns it. Written whole or not at all (a
    hard link of a finished file: exclusive on every filesystem, NFS included); a claim whose job is no longer
    active in Slurm is stale and replaced."""
    run = RunDir(run_dir)
    run.slurm.mkdir(parents=True, exist_ok=True)
    mine = run.claim_draft(job_id)
    for _ in range(5):
        mine.write_text(json.dumps({"job_id": job_id, "time": time.time(), "host": os.uname().nodename}))
        try:
            os.link(mine, run.job_claim)
            return None
        except FileExistsError:
            pass
        except OSError:  # a filesystem without hard links: an exclusive create (the claim is a few bytes)
            if _create_exclusive(run.job_claim, mine.read_bytes()):
                return None
        finally:
            mine.unlink(missing_ok=True)
        owner = _owner(run.job_claim)
        if owner is None:
            continue  # replaced meanwhile: try again
        if owner == job_id:
            return None
        state = _owner_state(owner) if owner else "UNKNOWN"
        if state is None:
            return (
                f"job {job_id} refused to start: Slurm cannot say whether job {owner}, which owns run dir "
                f"{str(run.root)!r}, is still active (sacct and squeue failed); submit it again once they answer"
            )
        if state in ACTIVE:
            return (
                f"job {job_id} refused to start: job {owner} ({state}) owns run dir {str(run.root)!r} "
                f"(one job per run directory); nothing in it was touched (areal-hpc status {run.root})"
            )
        # stale: moved aside under this job's own name; a newcomer's fresh claim moved by mistake goes back
        aside = run.claim_aside(job_id)
        try:
            os.replace(run.job_claim, aside)
        except FileNotFoundError:
            continue
        if _owner(aside) != owner:
            try:
                os.link(aside, run.job_claim)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)
    return f"job {job_id} could not claim run dir {str(run.root)!r}: its claim kept changing; submit it again"


def _create_exclusive(path: Path, data: bytes) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


def _owner_state(job_id: str) -> str | None:
    """A claim owner's state: sacct's, else squeue's (a job it does not know is gone); None when neither answers
    (accounting down): the caller refuses rather than guess."""
    try:
        return job_state(job_id)
    except SlurmError:
        pass
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    if out.returncode == 0:
        return (out.stdout.split() or ["GONE"])[0]
    return "GONE" if "Invalid job id" in out.stderr else None


def run_jobs(run_dir: os.PathLike | str) -> list[tuple[str, str]]:
    """(job id, state) of every active job of the run in RUN_DIR, oldest first: those in the queue whose output
    goes to its logs/ or slurm/submitit/ (a rendered script, submit, resume), and slurm/job.json's job."""
    run = RunDir(Path(run_dir).resolve())
    recorded = _recorded(run)
    return [
        (job_id, state)
        for job_id, state, out in queued_jobs(recorded)
        if state in ACTIVE and (job_id in recorded or (out is not None and out.parent in (run.logs, run.submitit)))
    ]


def _recorded(run: RunDir) -> set[str]:
    """slurm/job.json's job id (submitit's output may lie outside the run dir: a sweep's folder)."""
    try:
        return {str(load_job(run.root)["job_id"])} if run.job_file.exists() else set()
    except (SlurmError, OSError, ValueError, KeyError):
        return set()


def other_jobs_lines(run_dir: os.PathLike | str, shown: str) -> list[str]:
    """`status`'s lines for the run's active jobs other than the one it shows first."""
    try:
        jobs = run_jobs(run_dir)
    except SlurmError:
        return []
    owner = claim_owner(run_dir)
    owner = owner if any(j == owner for j, _ in jobs) else None
    lines = []
    for job_id, state in jobs:
        if job_id == shown:
            continue
        why = [pending_reason(job_id)] if state == "PENDING" else []
        if owner and owner != job_id:
            why.append(f"will refuse to start while job {owner} runs: one job per run directory")
        lines.append(f"also: job {job_id} {state}" + (f" ({'; '.join(why)})" if why else ""))
    return lines


def cancel_run(run_dir: os.PathLike | str) -> list[str]:
    """scancel every active job of the run (the queued ones first, so none starts on the owner's end); else
    slurm/job.json's job. The ids cancelled."""
    owner = claim_owner(run_dir)
    ids = [j for j, _ in run_jobs(run_dir)] or [str(load_job(Path(run_dir))["job_id"])]
    ids.sort(key=lambda j: j == owner)
    slurm_command(["scancel", *ids])
    return ids


if __name__ == "__main__":  # the batch script, before prepare: python -m areal_hpc.launch.jobs RUN_DIR
    from areal_hpc.launch.environment import slurm_job_id

    if refused := take_claim(sys.argv[1], slurm_job_id()):
        print(f"[areal] {refused}", flush=True)
        sys.exit(1)
