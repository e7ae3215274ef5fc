"""The run directory's names: the one place that spells every file a run writes (docs/run-dir.md)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

# Names inside the store and a version's folders, for the modules that write them (shards, engines, weight sync).
SHARD_SUFFIX = ".h5"
TMP_SUFFIX = ".tmp"  # ends every temporary an atomic write (utils) leaves if killed; a resume removes them
WEIGHTS_FILE = "model.safetensors"  # the torch trainer's checkpoint and a published version: Hugging Face's name
CHECKPOINT_META = "meta.json"  # every trainer checkpoint's record (version; LoRA's and DeepSpeed's shape), written last
TRAINER_STATE = "trainer_state.pt"  # the torch trainer's optimizer and RNG
ADAPTER_FILE = "adapter.safetensors"  # a LoRA checkpoint's weights: the adapter alone, fp32, published names
REFERENCE_FILE = "reference.safetensors"  # the reference policy with ppo.kl_coef: a resume keeps the same one
DEEPSPEED_TAG = "ds"  # the DeepSpeed trainers' shards, in this folder of the checkpoint
EMULATED_STATE = "emulated.json"  # the emulated trainer's checkpoint: its version and cost model
_VERSIONED = r"v(\d{8,})"
_CHECKPOINT_STATE_RE = re.compile(rf"^{_VERSIONED}\.scheduler\.json$")
_VERSION_DIR_RE = re.compile(rf"^{_VERSIONED}$")
_LEDGER_RE = re.compile(rf"^{_VERSIONED}\.json$")
_SHARD_RE = re.compile(rf"^g(\d+)-(\d+){re.escape(SHARD_SUFFIX)}$")


def _versioned(version: int) -> str:
    return f"v{version:08d}"


def _listdir(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def rng_file(rank: int) -> str:
    """A DeepSpeed trainer's RNG state in its checkpoint, one per trainer."""
    return f"rng_rank{rank}.pt"


def shared_temporary(final: Path) -> Path:
    """The folder the DeepSpeed trainers write together before it is published as `final`: one name every
    rank knows (an atomic write's own temporary is private to its process)."""
    return final.with_name(f"{final.name}.ds{TMP_SUFFIX}")


def shard_name(gen_rank: int, seq: int) -> str:
    """A shard's file name in RUN_DIR/rollouts: generator rank and its flush sequence number."""
    return f"g{gen_rank:03d}-{seq:08d}{SHARD_SUFFIX}"


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """(gen_rank, seq) for a shard file name, None for anything else (temporaries included)."""
    m = _SHARD_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (holds a run already, has nothing to resume)."""


class RunDir:
    """Every path of one run, as submitit's JobPaths is for a job. Ask it; never join folder names by hand.

    Names and read-only listings only: what writes or deletes (a new run, a start, pruning) is in
    rundir.actions. Cheap to build from a path (`RunDir(path)`), so modules that are handed a path wrap it.
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

    def ledger_files(self) -> list[tuple[int, Path]]:
        """(version, file) of every ledger file, oldest first; temporaries and strangers left out."""
        found = ((int(m.group(1)), n) for n in _listdir(self.ledger) if (m := _LEDGER_RE.match(n)))
        return [(v, self.ledger / n) for v, n in sorted(found)]

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
        names = _listdir(self.checkpoints)
        states = {int(m.group(1)) for n in names if (m := _CHECKPOINT_STATE_RE.match(n))}
        folders = {int(m.group(1)) for n in names if (m := _VERSION_DIR_RE.match(n))}
        return {v for v in folders if self.trainer_checkpoint(v).is_dir()}, states

    def complete_checkpoints(self) -> list[int]:
        """Versions with both the trainer folder and the scheduler state, oldest first."""
        folders, states = self.checkpoint_parts()
        return sorted(folders & states)

    def latest_checkpoint(self) -> int | None:
        """The newest version with both the trainer folder and the scheduler state, or None."""
        done = self.complete_checkpoints()
        return done[-1] if done else None

    @property
    def weights(self) -> Path:
        """Published weights for the disk sync path, one folder per version."""
        return self.root / "weights"

    def weights_version(self, version: int) -> Path:
        return self.weights / _versioned(version)

    def weights_file(self, version: int) -> Path:
        return self.weights_version(version) / WEIGHTS_FILE

    def published_weights(self) -> list[Path]:
        """The published versions' folders, oldest first (a folder being written is a temporary, left out)."""
        found = ((int(m.group(1)), n) for n in _listdir(self.weights) if (m := _VERSION_DIR_RE.match(n)))
        return [self.weights / n for _, n in sorted(found) if (self.weights / n).is_dir()]

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

    def temporaries(self) -> list[Path]:
        """Files and folders that atomic writes killed mid-write left in `durable_dirs` (never complete data)."""
        return [d / n for d in self.durable_dirs for n in _listdir(d) if TMP_SUFFIX in n]

    @property
    def storage_probe(self) -> Path:
        """The small file a start writes and removes to learn whether the run directory takes writes."""
        return self.root / f".probe-{os.getpid()}"

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

    def claim_draft(self, job_id: str) -> Path:
        """A job's claim written whole beside `job_claim` before it is linked into place."""
        return self.slurm / f".{self.job_claim.name}.{job_id}.{os.getpid()}"

    def claim_aside(self, job_id: str) -> Path:
        """Where job `job_id` moves a stale claim it replaces."""
        return self.slurm / f".{self.job_claim.name}.stale.{job_id}"

    @property
    def submitit(self) -> Path:
        return self.slurm / "submitit"

    def discarded(self) -> Path:
        """Where a start that died before its first checkpoint is set aside."""
        return self.root / f"discarded-{int(time.time())}"

    # -- what it holds ------------------------------------------------------------------------------
    def holds_run(self) -> bool:
        """Data, checkpoints or a submitted job are here: a new run must not reuse the folder."""
        return any(p.exists() for p in (self.rollouts, self.ledger, self.checkpoints, self.job_file))


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
