"""What writes or deletes in a run directory: a new run, every start's clean-up, the storage probe, pruning."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable

from areal_hpc.rundir import RunDir, RunDirError
from areal_hpc.utils import fsync_dir

NEW_RUN_HINT = "pick another run_name=... or store.run_dir=..."


def create(run: RunDir, cfg, queued: bool = False, hint: str = NEW_RUN_HINT) -> RunDir:
    """A new run: refuse a folder that holds one, then write the resolved config (store.run_dir absolute).

    `queued`: the run is submitted to start later (Slurm), so a config already here may belong to a
    job still waiting in the queue: refuse it too. `hint` ends the refusal: what the user can do.
    """
    from areal_hpc.config import save_config

    if run.holds_run() or (queued and run.config.exists()):
        raise RunDirError(f"run dir {str(run.root)!r} already holds a run; {hint}")
    run.root.mkdir(parents=True, exist_ok=True)
    run.logs.mkdir(exist_ok=True)
    cfg.store.run_dir = str(run.root)
    save_config(cfg, run.config)
    return run


def before_start(run: RunDir) -> None:
    """Every start (fresh, resumed or requeued): no stale stop request, error files or heartbeat (the job
    script's watchdog must time this start's rank 0, not an earlier job's)."""
    run.stop.unlink(missing_ok=True)
    run.heartbeat.unlink(missing_ok=True)
    run.logs.mkdir(parents=True, exist_ok=True)
    for old in run.rank_errors():
        old.unlink(missing_ok=True)


def storage_problem(run: RunDir) -> str | None:
    """One line if the run directory cannot take writes now (full, over quota, read-only), else None:
    a small file is written, synced and removed."""
    probe = run.storage_probe
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            return f"run dir {str(run.root)!r} cannot be written: {err.strerror}; make room or fix it, then resume"
        return None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def prune_checkpoints(run: RunDir, keep: int) -> list[int]:
    """Delete what `checkpoints_to_prune` lists (keep 0: nothing); returns those versions.

    Each goes state first, made durable, then its folder: a kill mid-delete leaves a folder without
    its state, which no resume takes for a checkpoint and the next prune removes."""
    doomed = checkpoints_to_prune(*run.checkpoint_parts(), keep)
    for v in doomed:
        run.scheduler_state(v).unlink(missing_ok=True)
        fsync_dir(run.checkpoints)
        if run.trainer_checkpoint(v).exists():
            shutil.rmtree(run.trainer_checkpoint(v))
    return doomed


def checkpoints_to_prune(folders: Iterable[int], states: Iterable[int], keep: int) -> list[int]:
    """The versions whose checkpoint files may go, oldest first: complete ones (folder and state) older than
    the newest `keep` complete ones, and parts of incomplete ones (a folder or a state alone: a crash
    mid-write or mid-delete) older than the newest complete one. Nothing newer than the newest complete
    checkpoint is listed: it may be one being written, and a resume never uses it. keep 0: nothing."""
    folders, states = set(folders), set(states)
    complete = sorted(folders & states)
    if keep <= 0 or not complete:
        return []
    kept = set(complete[-keep:])
    return sorted(v for v in folders | states if v < complete[-1] and v not in kept)
