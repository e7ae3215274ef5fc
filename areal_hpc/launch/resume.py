"""`areal-hpc resume`: a run on Slurm submitted again from its newest checkpoint, with the overrides that are safe."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

import yaml

from areal_hpc.config import Config, load_config, save_config, to_yaml
from areal_hpc.launch.jobs import run_jobs
from areal_hpc.launch.slurm import SlurmError, load_job, render_sbatch, save_job
from areal_hpc.model.record import model_fingerprint, model_mismatch, read_model_record, teacher_mismatch
from areal_hpc.rundir import RunDir
from areal_hpc.utils import atomic_write_text

# keys a resumed run cannot take new values for, and why: its checkpoint, ledger and store were made with them
FIXED = {
    "model.": "the checkpoint holds this model's weights",
    "data.": "the ledger and the stored groups refer to this dataset's prompts",
    "rollout.batch_prompts": "the scheduler's checkpoint counts batches of this size",
    "rollout.n_samples": "the stored groups have this many samples",
    "rollout.eta": "the stored groups were admitted under this staleness bound",
    "cluster.n_trainers": "the trainers' checkpoint is written by (and sharded over) this many ranks",
    "trainer.engine": "the checkpoint is in this engine's format",
    "trainer.zero_stage": "the checkpoint's shards are laid out for this ZeRO stage",
}
# the same files, moved: a resume may point at them again (model.path: checked against RUN_DIR/model.json, see
# model_problem; data.path: against dataset.json when rank 0 starts)
MOVABLE = {"model.path", "data.path"}


class ResumeError(ValueError):
    """A resume that cannot go ahead; one line naming why. Nothing in the run directory changed."""


def fixed_key(key: str) -> str | None:
    """Why this config key cannot take a new value on resume, or None when it may."""
    if key in MOVABLE:
        return None
    for prefix, why in FIXED.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return f"{key} cannot change when a run resumes: {why}; start a new run for that"
    return None


def refused_change(old: Config, new: Config) -> str | None:
    """One line for the first changed value a resumed run cannot take (the same value given again is fine)."""
    for key in changed_keys(old, new):
        if (why := fixed_key(key)) is not None:
            return why
    return None


def changed_keys(old: Config, new: Config) -> dict[str, dict]:
    """Dotted key -> {"from": old, "to": new} for every value that differs."""

    def flat(cfg: Config) -> dict:
        tree = yaml.safe_load(to_yaml(cfg))
        out = {}

        def walk(node, prefix):
            for k, v in node.items():
                if isinstance(v, dict) and v:
                    walk(v, f"{prefix}{k}.")
                else:
                    out[f"{prefix}{k}"] = v

        walk(tree, "")
        return out

    a, b = flat(old), flat(new)
    return {k: {"from": a.get(k), "to": b[k]} for k in b if a.get(k) != b[k]}


def plan_resume(run_dir: str | Path, overrides: list[str]) -> tuple[Config, dict[str, dict], int | None]:
    """The resumed run's config, what changes and the checkpoint it starts from; ResumeError before anything is
    written when it cannot resume."""
    run = RunDir(Path(run_dir).resolve())
    if not run.config.is_file():
        raise ResumeError(f"{str(run.root)!r} holds no run (no config.yaml); start one with areal-hpc submit or render")
    old = load_config(run.config)
    overrides = more_versions(overrides, run.latest_checkpoint())
    new = load_config(run.config, [*overrides, f"store.run_dir={run.root}"])  # the folder may have moved
    if (why := refused_change(old, new)) is not None:
        raise ResumeError(why)
    if run.job_file.exists() or run.logs.exists():
        try:
            active = run_jobs(run.root)
        except SlurmError:
            active = []
        if active:
            jobs = ", ".join(f"job {j} of this run is still {state}" for j, state in active)
            raise ResumeError(f"{jobs}: cancel it first (areal-hpc cancel {run.root})")
    if (why := model_problem(run, old, new) or teacher_mismatch(run.root, new.distill.teacher)) is not None:
        raise ResumeError(why)  # before anything is written: the job's script would refuse it after the queue
    ckpt = run.latest_checkpoint()
    if ckpt is not None and new.trainer.versions <= ckpt:
        raise ResumeError(
            f"the run's checkpoint is at version {ckpt} and trainer.versions={new.trainer.versions}: nothing left "
            f"to train; ask for more, e.g. trainer.versions={ckpt + max(1, new.trainer.versions)}"
        )
    return new, changed_keys(old, new), ckpt


def more_versions(overrides: list[str], ckpt: int | None) -> list[str]:
    """`trainer.versions=+N`: N versions more than the checkpoint the run resumes from (trainer.versions is the
    run's total, and where a cancel stopped it is not known in advance)."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() == "trainer.versions" and value.strip().startswith("+"):
            n = value.strip()[1:]
            if not n.isdigit() or int(n) < 1:
                raise ResumeError(f"trainer.versions={value.strip()}: +N asks for N more versions, N >= 1")
            o = f"trainer.versions={(ckpt or 0) + int(n)}"
        out.append(o)
    return out


def model_problem(run: RunDir, old: Config, new: Config) -> str | None:
    """One line if new.model.path is not the run's model: RUN_DIR/model.json's, or for a run that has none (it
    started before runs recorded their model) the old model.path's files while they exist. A folder that does
    not exist is refused, build_tiny or not: a resume would build another model there."""
    rec = read_model_record(run.root)
    old_path, new_path = Path(old.model.path), Path(new.model.path)
    if rec is None and new_path.resolve() != old_path.resolve() and (old_path / "config.json").is_file():
        rec = model_fingerprint(old_path)
    if rec is None and not new_path.exists():
        return f"model.path={str(new_path)!r} does not exist; a resume needs the run's model files (moved, not rebuilt)"
    return model_mismatch(run.root, new_path, rec) if rec is not None else None


def record_history(run: RunDir, changes: dict[str, dict], ckpt: int | None, command: str) -> None:
    """One dated entry per resume in config-history.yaml (rewritten atomically)."""
    entries = yaml.safe_load(run.config_history.read_text()) if run.config_history.exists() else []
    when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    entries.append({"time": when, "command": command, "from_checkpoint": ckpt, "changes": changes})
    atomic_write_text(run.config_history, yaml.safe_dump(entries, sort_keys=False))


def submit_sbatch(cfg: Config, run: RunDir, source: str) -> str:
    """The run's batch script, rendered into RUN_DIR/slurm/job.sbatch and submitted with sbatch; its job id."""
    run.slurm.mkdir(parents=True, exist_ok=True)
    run.logs.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run.job_script, render_sbatch(cfg, source))
    out = subprocess.run(["sbatch", "--parsable", str(run.job_script)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {' '.join((out.stderr or out.stdout).split())[-300:]}")
    job_id = out.stdout.strip().split(";")[0]
    save_job(run.root, {"job_id": job_id, "submitted_by": "sbatch", "script": str(run.job_script)})
    return job_id


def resume(run_dir: str | Path, overrides: list[str], via: str | None = None) -> tuple[str, dict, int | None]:
    """Submit the run in RUN_DIR again (via 'sbatch' or 'submitit'; default: how it was submitted before).
    Returns (job id, the config's changes, the checkpoint it resumes from)."""
    from areal_hpc.launch.request_checks import check_all

    run = RunDir(Path(run_dir).resolve())
    cfg, changes, ckpt = plan_resume(run.root, overrides)
    check_all(cfg, "resume")  # every problem of the request at once
    if via is None:
        try:
            via = "submitit" if load_job(run.root).get("submitted_by") == "submitit" else "sbatch"
        except SlurmError:
            via = "sbatch"
    before = run.config.read_text()
    command = " ".join(["areal-hpc resume", str(run.root), *overrides, f"--{via}"])
    save_config(cfg, run.config)  # before the job exists: a job that starts at once reads the new config
    try:
        if via == "submitit":
            from areal_hpc.launch.submit import queue

            job_id = queue(cfg, run.root).job_id
        else:
            job_id = submit_sbatch(cfg, run, command)
    except BaseException:
        atomic_write_text(run.config, before)  # nothing was queued: the run stays as it was
        raise
    record_history(run, changes, ckpt, command)
    return job_id, changes, ckpt


def describe_changes(changes: dict[str, dict]) -> str:
    if not changes:
        return "no config change"
    return ", ".join(f"{k}: {v['from']} -> {v['to']}" for k, v in changes.items())
