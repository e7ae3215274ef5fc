"""The run directory's layout: the one place that knows the name of every file a run writes (docs/run-dir.md)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from areal_hpc.utils import fsync_dir

_CHECKPOINT_STATE_RE = re.compile(r"^v(\d{8})\.scheduler\.json$")
_CHECKPOINT_DIR_RE = re.compile(r"^v(\d{8})$")


def _versioned(version: int) -> str:
    return f"v{version:08d}"


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (holds a run already, has nothing to resume)."""


class RunDir:
    """Every path of one run, as submitit's JobPaths is for a job. Ask it; never join folder names by hand.

    Cheap to build from a path (`RunDir(path)`), so modules that are handed a path wrap it where they need one.
    """

    def __init__(self, root: os.PathLike | str | RunDir):
        self.root = Path(root.root if isinstance(root, RunDir) else root)

    def __fspath__(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def __str__(self) -> str:
        return str(self.root)

    # -- files at the top -------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        """The resolved config every rank reads (and a resume starts from)."""
        return self.root / "config.yaml"

    @property
    def config_history(self) -> Path:
        """Every resume's changes to config.yaml, dated (areal-hpc resume appends)."""
        return self.root / "config-history.yaml"

    @property
    def stop(self) -> Path:
        """Touching it asks a run to checkpoint and stop (the launchers do it on Ctrl-C or a Slurm signal)."""
        return self.root / "STOP"

    @property
    def progress(self) -> Path:
        return self.root / "progress.json"

    def read_progress(self) -> dict | None:
        """progress.json's contents; None before the first version (or while a crash left none)."""
        try:
            return json.loads(self.progress.read_text())
        except (OSError, ValueError):
            return None

    @property
    def summary(self) -> Path:
        """Written last by rank 0: its presence means the run finished."""
        return self.root / "summary.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.csv"

    @property
    def dataset(self) -> Path:
        """The run's data by fingerprint (a file's sha256, or the arithmetic task's), written at its first start."""
        return self.root / "dataset.json"

    @property
    def model(self) -> Path:
        """The run's model by fingerprint (config.json's and the weights' sha256), written at its first start:
        a later start or a resume may point model.path at the same files moved, never at another model."""
        return self.root / "model.json"

    @property
    def teacher(self) -> Path:
        """The distillation teacher by fingerprint, written at the first start: a resume keeps the same teacher."""
        return self.root / "teacher.json"

    @property
    def model_hashes(self) -> Path:
        """A cache of model files' sha256 by path, size and mtime: an unchanged model is hashed once."""
        return self.root / "model-hashes.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        """W&B's folder (wandb.init(dir=root) makes it): offline-run-*/ per launch, for `wandb sync`."""
        return self.root / "wandb"

    @property
    def mlflow(self) -> Path:
        """MLflow's file store, unless logging.mlflow_uri names another."""
        return self.root / "mlruns"

    @property
    def trackers_state(self) -> Path:
        """Each tracker run's id and last version sent: a resume continues the same W&B and MLflow runs."""
        return self.root / "trackers.json"

    # -- data -------------------------------------------------------------------------------------
    @property
    def rollouts(self) -> Path:
        """The shard store (one immutable HDF5 file per flush of a generator)."""
        return self.root / "rollouts"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger"

    def ledger_file(self, version: int) -> Path:
        return self.ledger / f"{_versioned(version)}.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def trainer_checkpoint(self, version: int) -> Path:
        return self.checkpoints / _versioned(version)

    def scheduler_state(self, version: int) -> Path:
        """Written after the trainers' checkpoint is in place: its presence marks the checkpoint complete."""
        return self.checkpoints / f"{_versioned(version)}.scheduler.json"

    def checkpoint_parts(self) -> tuple[set[int], set[int]]:
        """The versions with a trainer folder, and those with a scheduler state (both: complete)."""
        try:
            names = os.listdir(self.checkpoints)
        except FileNotFoundError:
            return set(), set()
        states = {int(m.group(1)) for n in names if (m := _CHECKPOINT_STATE_RE.match(n))}
        folders = {int(m.group(1)) for n in names if (m := _CHECKPOINT_DIR_RE.match(n))}
        return {v for v in folders if self.trainer_checkpoint(v).is_dir()}, states

    def complete_checkpoints(self) -> list[int]:
        """Versions with both the trainer folder and the scheduler state, oldest first."""
        folders, states = self.checkpoint_parts()
        return sorted(folders & states)

    def latest_checkpoint(self) -> int | None:
        """The newest version with both the trainer folder and the scheduler state, or None."""
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def prune_checkpoints(self, keep: int) -> list[int]:
        """Delete what `checkpoints_to_prune` lists (keep 0: nothing); returns those versions.

        Each goes state first, made durable, then its folder: a kill mid-delete leaves a folder without
        its state, which no resume takes for a checkpoint and the next prune removes."""
        doomed = checkpoints_to_prune(*self.checkpoint_parts(), keep)
        for v in doomed:
            self.scheduler_state(v).unlink(missing_ok=True)
            fsync_dir(self.checkpoints)
            if self.trainer_checkpoint(v).exists():
                shutil.rmtree(self.trainer_checkpoint(v))
        return doomed

    @property
    def weights(self) -> Path:
        """Published weights for the disk sync path, one folder per version."""
        return self.root / "weights"

    def weights_version(self, version: int) -> Path:
        return self.weights / _versioned(version)

    @property
    def lora_contract(self) -> Path:
        """With LoRA: what generators need to apply the published adapters (base folder and its checksum,
        rank, alpha, layers), written by trainer 0 before it announces any weights."""
        return self.weights / "lora.json"

    @property
    def base_model(self) -> Path:
        """With LoRA and a warm start: the warm-started model (a Hugging Face folder) the adapter trains on.
        Absent otherwise: the adapter applies to model.path."""
        return self.root / "base_model"

    @property
    def quarantine(self) -> Path:
        """Shards a resume found corrupt (torn, flipped bytes), moved out of the store; their groups regenerate."""
        return self.root / "quarantine"

    @property
    def durable_dirs(self) -> tuple[Path, ...]:
        """Where atomic writes leave temporaries if killed mid-write."""
        return self.rollouts, self.checkpoints, self.ledger, self.weights

    # -- logs -------------------------------------------------------------------------------------
    @property
    def timeline(self) -> Path:
        return self.root / "timeline"

    def timeline_log(self, rank: int) -> Path:
        return self.timeline / f"rank{rank:03d}.csv"

    def engine_log(self, rank: int) -> Path:
        return self.timeline / f"engine-rank{rank:03d}.csv"

    def timeline_logs(self) -> list[Path]:
        return sorted(self.timeline.glob("rank*.csv"))

    def engine_logs(self) -> list[Path]:
        return sorted(self.timeline.glob("engine-rank*.csv"))

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def rank_log(self, rank: int, role: str) -> Path:
        return self.logs / f"rank{rank:03d}-{role}.log"

    @property
    def heartbeat(self) -> Path:
        """Rank 0's heartbeat (its time, rewritten every cluster.hang_timeout_s / 4): the job script's watchdog."""
        return self.logs / "heartbeat.json"

    @property
    def restarts(self) -> Path:
        """Every automatic restart inside an allocation: when, why, with which exit code."""
        return self.root / "restarts.json"

    def rank_pid(self, rank: int) -> Path:
        return self.logs / f"rank{rank:03d}.pid"

    def rank_error(self, rank: int) -> Path:
        """One line naming the rank and its error, written before the rank aborts the job."""
        return self.logs / f"error-rank{rank:03d}.txt"

    def rank_errors(self) -> list[Path]:
        """Error files, first written first: the first is the cause, later ones are peers losing it. A file a
        new world's start removes meanwhile is left out (status reads them while a job runs)."""
        found = []
        for p in self.logs.glob("error-rank*.txt"):
            try:
                found.append((p.stat().st_mtime_ns, p))
            except FileNotFoundError:
                continue
        return [p for _, p in sorted(found)]

    def log_of_error(self, error_file: Path) -> Path | None:
        """The rank log that goes with an error file."""
        rank = error_file.name.removeprefix("error-").removesuffix(".txt")
        return next(self.logs.glob(f"{rank}-*.log"), None)

    @property
    def eval_output(self) -> str:
        """`areal-hpc eval --slurm` jobs' output (sbatch fills in %j)."""
        return str(self.logs / "eval-%j.out")

    @property
    def mpirun_log(self) -> Path:
        return self.logs / "mpirun.log"

    @property
    def slurm_output(self) -> str:
        """The batch script's output, as an #SBATCH --output pattern (%j: the job id)."""
        return str(self.logs / "slurm-%j.out")

    def slurm_output_of(self, job_id: str) -> Path:
        """Job `job_id`'s batch script output (appended across its requeues)."""
        return Path(self.slurm_output.replace("%j", str(job_id)))

    # -- Slurm ------------------------------------------------------------------------------------
    @property
    def slurm(self) -> Path:
        return self.root / "slurm"

    @property
    def job_script(self) -> Path:
        """The batch script `areal-hpc resume` rendered and submitted (the latest)."""
        return self.slurm / "job.sbatch"

    @property
    def job_file(self) -> Path:
        """How the run was submitted: job id, by whom, submitit's folder."""
        return self.slurm / "job.json"

    @property
    def job_claim(self) -> Path:
        """The Slurm job that owns the run (one job per run dir): taken by the job at start-up, before prepare."""
        return self.slurm / "claim.json"

    @property
    def submitit(self) -> Path:
        return self.slurm / "submitit"

    def discarded(self) -> Path:
        """Where a start that died before its first checkpoint is set aside."""
        return self.root / f"discarded-{int(time.time())}"

    # -- lifecycle --------------------------------------------------------------------------------
    def holds_run(self) -> bool:
        """Data, checkpoints or a submitted job are here: a new run must not reuse the folder."""
        return any(p.exists() for p in (self.rollouts, self.ledger, self.checkpoints, self.job_file))

    def create(self, cfg, queued: bool = False, hint: str = "pick another run_name=... or store.run_dir=...") -> RunDir:
        """A new run: refuse a folder that holds one, then write the resolved config (store.run_dir absolute).

        `queued`: the run is submitted to start later (Slurm), so a config already here may belong to a
        job still waiting in the queue: refuse it too. `hint` ends the refusal: what the user can do.
        """
        from areal_hpc.config import save_config

        if self.holds_run() or (queued and self.config.exists()):
            raise RunDirError(f"run dir {str(self.root)!r} already holds a run; {hint}")
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        cfg.store.run_dir = str(self.root)
        save_config(cfg, self.config)
        return self

    def storage_problem(self) -> str | None:
        """One line if the run directory cannot take writes now (full, over quota, read-only), else None:
        a small file is written, synced and removed."""
        probe = self.root / f".probe-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 65536)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                return f"run dir {str(self.root)!r} cannot be written: {err.strerror}; make room or fix it, then resume"
            return None
        finally:
            try:
                probe.unlink()
            except OSError:
                pass
        return None

    def before_start(self) -> None:
        """Every start (fresh, resumed or requeued): no stale stop request, error files or heartbeat (the job
        script's watchdog must time this start's rank 0, not an earlier job's)."""
        self.stop.unlink(missing_ok=True)
        self.heartbeat.unlink(missing_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        for old in self.logs.glob("error-rank*.txt"):
            old.unlink()


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


class SweepDir:
    """A sweep's folder: its record of points and submitit's folder; each point's RunDir lies inside."""

    def __init__(self, root: os.PathLike | str):
        self.root = Path(root)

    @property
    def record(self) -> Path:
        return self.root / "sweep.json"

    @property
    def submitit(self) -> Path:
        return self.root / "submitit"

    def point(self, name: str) -> RunDir:
        return RunDir(self.root / name)
