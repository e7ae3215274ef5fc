"""Local launcher: one `mpirun` for the whole run, a progress bar from the run dir, a summary at the end."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from areal_hpc.config import Config, save_config
from areal_hpc.launch.environment import rank_env
from areal_hpc.launch.progress_view import ProgressLines, reward_failures
from areal_hpc.rundir import RunDir, RunDirError
from areal_hpc.rundir import actions as rundir_actions
from areal_hpc.rundir.lifetime import MARKER, sweep, tied_to_me
from areal_hpc.runtime.comm.layout import Layout
from areal_hpc.runtime.comm.liveness import silence_verdict
from areal_hpc.runtime.cores import CoreSplit
from areal_hpc.runtime.failures import PEER, read_failures
from areal_hpc.utils import on_terminal


class RunFailed(RuntimeError):
    """The run ended badly; the message is one line (which rank, what error, where the logs are)."""


def mpirun_command(cfg: Config, run_dir: Path, resume: bool) -> list[str]:
    layout = Layout.from_counts(cfg.cluster.n_generators, cfg.cluster.n_trainers)
    mpirun = shutil.which(cfg.cluster.mpirun)
    if mpirun is None:
        raise RunFailed(f"cluster.mpirun={cfg.cluster.mpirun!r} is not on PATH; install Open MPI (env/setup.sh)")
    cmd = [
        mpirun,
        "-n",
        str(layout.world_size),
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        "-m",
        "areal_hpc.runtime.worker",
        str(run_dir),
    ]
    return cmd + (["--resume"] if resume else [])


def crowded_generation(cfg: Config, cores: int) -> str | None:
    """With cluster.pin_roles a generator's engine workers (one per device, tensor parallel) inherit its cores,
    the generation half of the host's (runtime/cores.py): a warning when they hold fewer cores than those
    workers' threads. The ranks are the same either way."""
    cc = cfg.cluster
    if not cc.pin_roles or cc.devices_per_generator == 1:
        return None
    half = len(CoreSplit.of(set(range(cores))).generation)
    need = cc.n_generators * cc.devices_per_generator * cc.threads_per_rank
    if need <= half:
        return None
    return (
        f"cluster.pin_roles gives generation {half} of {cores} cores, and its {cc.n_generators} generator(s) x "
        f"cluster.devices_per_generator={cc.devices_per_generator} workers x cluster.threads_per_rank="
        f"{cc.threads_per_rank} want {need}: they share them"
    )


def prepare_run_dir(cfg: Config, resume: bool) -> RunDir:
    """A new run dir (refusing one that holds a run) or an existing one with a checkpoint to resume."""
    from areal_hpc.runtime.rank0.resume import CheckpointError
    from areal_hpc.runtime.startup_checks import StartRefused, check_start, record_start

    run = RunDir(Path(cfg.store.run_dir).resolve())
    try:
        check_start(cfg, run.root, resume)  # every check, one line each, before the run dir is written
        if resume:
            save_config(cfg, run.config)  # a resume may change settings (more versions, a new time limit)
        else:
            rundir_actions.create(run, cfg, hint="resume it with --resume or pick another run_name=...")
    except (RunDirError, CheckpointError, StartRefused) as err:
        raise RunFailed(str(err)) from None
    record_start(run, cfg)
    return run


def failure_line(run_dir: Path, returncode: int) -> str:
    """One line naming why a run failed: rank 0's verdict on a silent rank first, then a rank killed by a
    signal (its peers' errors, such as a reset connection, follow from it), else the first rank's own
    error, else mpirun's exit code."""
    run = RunDir(run_dir)
    if problem := rundir_actions.storage_problem(run):  # the ranks' own error lines could not be written there either
        return problem
    failures = read_failures(run)
    if silent := silence_verdict([f.line for f in failures]):  # mpirun's kill of the stopped rank follows it
        return f"{silent} (logs: {run.logs})"
    erred = {int(re.search(r"(\d+)", f.path.stem).group(1)) for f in failures}
    lines = run.mpirun_log.read_text(errors="replace").splitlines() if run.mpirun_log.exists() else []
    signalled = [
        ln.strip()
        for ln in lines
        if (m := re.search(r"process rank (\d+) .*exited on signal", ln)) and int(m.group(1)) not in erred
    ]
    if failures and not signalled:
        # a rank's own error before the peers' echoes of losing it (runtime/failures.py)
        first = next((f for f in failures if f.kind != PEER), failures[0])
        return f"{first.line} (log: {run.log_of_error(first.path) or run.logs})"
    hints = signalled or [ln.strip() for ln in lines if "exited on signal" in ln or "killed" in ln.lower()]
    hint = f": {hints[0]}" if hints else ""
    return f"mpirun exited with code {returncode}{hint} (logs: {run.logs})"


def launch(cfg: Config, resume: bool = False, progress: bool = True, stop_grace_s: float | None = None) -> dict:
    """Run the whole job under mpirun and return summary.json's contents; raises RunFailed with one line.

    Ctrl-C or SIGTERM asks the run to stop (docs/reliability.md, "Stopping"); after stop_grace_s (default: 120 s
    for the version on the trainers and the checkpoint, plus logging.stop_eval_s) mpirun is killed."""
    if stop_grace_s is None:
        stop_grace_s = 120.0 + cfg.logging.stop_eval_s
    run_dir = prepare_run_dir(cfg, resume)
    cmd = mpirun_command(cfg, run_dir.root, resume)
    run_dir.progress.unlink(missing_ok=True)
    env = rank_env(local_mpirun=True) | {MARKER: str(run_dir.root)}  # every process of the run carries it
    with open(run_dir.mpirun_log, "ab") as mpilog:
        # own session: a terminal's Ctrl-C reaches only this launcher, which then stops the run cleanly; a
        # launcher killed outright takes mpirun with it (SIGTERM: mpirun then kills its ranks)
        proc = subprocess.Popen(
            cmd, stdout=mpilog, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=tied_to_me()
        )
    # a bar on a terminal; where stderr is a file or a pipe (a Slurm log, `> file`) a plain line a few times a minute
    lines = ProgressLines() if progress and not on_terminal() else None
    bar = tqdm(
        total=cfg.trainer.versions,
        desc="versions",
        disable=not progress or lines is not None,
        unit="v",
        dynamic_ncols=True,
    )
    stop_asked_at = None
    shown_warning = None  # progress.json's warning, printed once each time it changes
    if progress and (crowded := crowded_generation(cfg, len(os.sched_getaffinity(0)))):
        tqdm.write(f"warning: {crowded}", file=sys.stderr)

    def _as_interrupt(*_):
        raise KeyboardInterrupt

    # a launcher told to end (SIGTERM, a closed terminal) stops the run as Ctrl-C does, never orphans it
    old_handlers = {sig: signal.signal(sig, _as_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while proc.poll() is None:
            try:
                time.sleep(0.5)
                p = run_dir.read_progress()
                if p and p.get("warning") and p["warning"] != shown_warning:
                    shown_warning = p["warning"]
                    tqdm.write(f"warning: {shown_warning}", file=sys.stderr)
                if lines is not None:
                    if line := lines.line(time.time(), p):
                        print(line, file=sys.stderr, flush=True)
                elif p and progress:
                    bar.n = p["version"]
                    post = {"tok/s": f"{p['consumed_tokens_per_s']:.0f}"}
                    if p.get("reward_mean") is not None:
                        post["reward"] = f"{p['reward_mean']:.3f}"
                    if p.get("heldout_acc") is not None:
                        post["acc"] = f"{p['heldout_acc']:.3f}"
                    post |= reward_failures(p)
                    if ev := p.get("eval"):  # a held-out evaluation running: how far it got
                        late = f", {ev['reward_timeouts']} reward time-outs" if ev["reward_timeouts"] else ""
                        post["eval"] = f"{ev['tag']} {ev['done']}/{ev['total']}{late}"
                    bar.set_postfix(post, refresh=False)
                    bar.refresh()
                if stop_asked_at and time.time() - stop_asked_at > stop_grace_s:
                    # past the stop's bound: mpirun ends its ranks on SIGTERM; SIGKILL if that did not do
                    late = time.time() - stop_asked_at > stop_grace_s + 10
                    os.killpg(proc.pid, signal.SIGKILL if late else signal.SIGTERM)
            except KeyboardInterrupt:
                if stop_asked_at is None:
                    tqdm.write("stopping: finishing the current version and checkpointing (Ctrl-C again to kill)")
                    run_dir.stop.touch()
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
        if lines is not None and (line := lines.final(run_dir.read_progress())):
            print(line, file=sys.stderr, flush=True)
        _sweep(run_dir)
    if proc.returncode != 0:
        raise RunFailed(failure_line(run_dir.root, proc.returncode))
    return json.loads(run_dir.summary.read_text())


def _sweep(run_dir: RunDir) -> None:
    """mpirun has exited: whatever of the run is still alive (a process that escaped its parent's death) is
    killed, and named in mpirun.log."""
    ended = sweep(run_dir.root)
    if ended:  # worded apart from mpirun's own lines on a killed rank, which failure_line looks for
        with open(run_dir.mpirun_log, "a") as f:
            f.write(f"[areal] ended {len(ended)} processes the run left behind: {'; '.join(ended)}\n")


def staleness_histogram(run_dir: Path) -> dict[int, int]:
    """Consumed trajectories per staleness value, from the store and ledger."""
    from areal_hpc.store import load_trajectories

    df = load_trajectories(run_dir, verify_tokens=False)
    s = df.loc[df["consumed_version"] >= 0, "staleness"].astype(int)
    return {int(k): int(v) for k, v in s.value_counts().sort_index().items()}
