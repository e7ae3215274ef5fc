"""Local launcher: one `mpirun` for the whole run, a progress bar from the run dir, a summary at the end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from areal_hpc.config import Config, save_config
from areal_hpc.engines import require_installed
from areal_hpc.runtime.layout import Layout
from areal_hpc.runtime.resume import latest_checkpoint
from areal_hpc.runtime.scheduler import STOP_FILE
from areal_hpc.runtime.worker import LOGS_SUBDIR


class RunFailed(RuntimeError):
    """The run ended badly; the message is one line (which rank, what error, where the logs are)."""


def mpi_env() -> dict[str, str]:
    """Open MPI settings that work on a single host, as root, in containers."""
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # no cross-memory attach in many containers: copy through shared memory instead
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def mpirun_command(cfg: Config, run_dir: Path, resume: bool) -> list[str]:
    layout = Layout.from_counts(cfg.cluster.n_generators, cfg.cluster.n_trainers)
    mpirun = shutil.which(cfg.cluster.mpirun)
    if mpirun is None:
        raise RunFailed(f"cluster.mpirun={cfg.cluster.mpirun!r} is not on PATH; install Open MPI (env/setup.sh)")
    cmd = [mpirun, "-n", str(layout.world_size), "--oversubscribe", "--bind-to", "none",
           sys.executable, "-m", "areal_hpc.runtime.worker", str(run_dir)]
    return cmd + (["--resume"] if resume else [])


def prepare_run_dir(cfg: Config, resume: bool) -> Path:
    """A new run dir (refusing one that holds a run) or an existing one with a checkpoint to resume."""
    from areal_hpc.model import ensure_model

    run_dir = Path(cfg.store.run_dir).resolve()
    if resume:
        if latest_checkpoint(run_dir) is None:
            raise RunFailed(f"run dir {str(run_dir)!r} has no complete checkpoint to resume from")
    elif (run_dir / "rollouts").exists() or (run_dir / "ledger").exists() or (run_dir / "checkpoints").exists():
        raise RunFailed(f"run dir {str(run_dir)!r} already holds a run; resume it with --resume or pick another run_name=...")
    run_dir.mkdir(parents=True, exist_ok=True)
    ensure_model(cfg.model)  # built once here, never by several ranks at once
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    logs = run_dir / LOGS_SUBDIR
    logs.mkdir(exist_ok=True)
    for old in logs.glob("error-rank*.txt"):
        old.unlink()
    return run_dir


def failure_line(run_dir: Path, returncode: int) -> str:
    # the first error written is the cause; later ones are usually peers losing their connection
    errors = sorted((run_dir / LOGS_SUBDIR).glob("error-rank*.txt"), key=lambda p: p.stat().st_mtime_ns)
    if errors:
        first = errors[0].read_text().strip()
        log = next((run_dir / LOGS_SUBDIR).glob(errors[0].name.replace("error-", "").replace(".txt", "-*.log")), None)
        return f"{first} (log: {log or run_dir / LOGS_SUBDIR})"
    mpilog = run_dir / LOGS_SUBDIR / "mpirun.log"
    hint = ""
    if mpilog.exists():
        lines = [ln.strip() for ln in mpilog.read_text(errors="replace").splitlines() if "exited on signal" in ln or "killed" in ln.lower()]
        hint = f": {lines[0]}" if lines else ""
    return f"mpirun exited with code {returncode}{hint} (logs: {run_dir / LOGS_SUBDIR})"


def _read_progress(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return None


def launch(cfg: Config, resume: bool = False, progress: bool = True, stop_grace_s: float = 120.0) -> dict:
    """Run the whole job under mpirun and return summary.json's contents; raises RunFailed with one line."""
    require_installed(cfg.rollout.engine, cfg.trainer.engine)
    run_dir = prepare_run_dir(cfg, resume)
    cmd = mpirun_command(cfg, run_dir, resume)
    (run_dir / "progress.json").unlink(missing_ok=True)
    with open(run_dir / LOGS_SUBDIR / "mpirun.log", "ab") as mpilog:
        # own session: a terminal's Ctrl-C reaches only this launcher, which then stops the run cleanly
        proc = subprocess.Popen(cmd, stdout=mpilog, stderr=subprocess.STDOUT, env=mpi_env(), start_new_session=True)
    bar = tqdm(total=cfg.trainer.versions, desc="versions", disable=not progress, unit="v", dynamic_ncols=True)
    stop_asked_at = None

    def _as_interrupt(*_):
        raise KeyboardInterrupt

    # a launcher told to end (SIGTERM, a closed terminal) stops the run as Ctrl-C does, never orphans it
    old_handlers = {sig: signal.signal(sig, _as_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while proc.poll() is None:
            try:
                time.sleep(0.5)
                p = _read_progress(run_dir)
                if p and progress:
                    bar.n = p["version"]
                    post = {"tok/s": f"{p['consumed_tokens_per_s']:.0f}"}
                    if p.get("reward_mean") is not None:
                        post["reward"] = f"{p['reward_mean']:.3f}"
                    if p.get("heldout_acc") is not None:
                        post["acc"] = f"{p['heldout_acc']:.3f}"
                    bar.set_postfix(post, refresh=False)
                    bar.refresh()
                if stop_asked_at and time.time() - stop_asked_at > stop_grace_s:
                    os.killpg(proc.pid, signal.SIGTERM)
            except KeyboardInterrupt:
                if stop_asked_at is None:
                    tqdm.write("stopping: finishing the current version and checkpointing (Ctrl-C again to kill)")
                    (run_dir / STOP_FILE).touch()
                    stop_asked_at = time.time()
                else:
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # an exception in this loop: never leave ranks behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        bar.close()
    if proc.returncode != 0:
        raise RunFailed(failure_line(run_dir, proc.returncode))
    return json.loads((run_dir / "summary.json").read_text())


def staleness_histogram(run_dir: Path) -> dict[int, int]:
    """Consumed trajectories per staleness value, from the store and ledger."""
    from areal_hpc.store import load_trajectories

    df = load_trajectories(run_dir, verify_tokens=False)
    s = df.loc[df["consumed_version"] >= 0, "staleness"].astype(int)
    return {int(k): int(v) for k, v in s.value_counts().sort_index().items()}
