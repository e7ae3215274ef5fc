"""What every MPI rank runs: `python -m areal_hpc.runtime.worker RUN_DIR [--resume|--resume-auto] [--group G]`.

Locally roles come from the config's counts; under a heterogeneous Slurm job each rank is told its
component (`--group train` for scheduler + trainers, `--group gen` for generators). `--resume-auto`
resumes when the run dir has a complete checkpoint and starts fresh otherwise (a requeued job).

Each rank writes RUN_DIR/logs/rank{r}-{role}.log (its stdout and stderr too) and a pid file. A rank that
fails writes one line naming itself and the error to RUN_DIR/logs/error-rank{r}.txt, then aborts the MPI
job, so no rank is left waiting on a dead peer. The file's second line is the error's kind (runtime/failures.py):
raised before the role loop ran by the rank's own set-up (the job does not restart a world for that), a lost
peer, or the rank's own failure. Rank 0 writes its heartbeat file from its start (runtime/comm/liveness.py).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from areal_hpc.rundir import RunDir
from areal_hpc.rundir.lifetime import MARKER
from areal_hpc.runtime.failures import error_file_text, kind_of, loop_started
from areal_hpc.utils import atomic_write_text


def _redirect_output(path: Path) -> None:
    """Send this process's stdout/stderr (Python and C level) to its own log file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _pin_gpus(count: int = 1) -> None:
    """This rank sees `count` GPUs (a generator's cluster.devices_per_generator, its engine's tensor-parallel
    group; one otherwise), from local rank x count on the node, the first as cuda:0 (before CUDA starts).

    Every engine and thread then means the same device by "cuda" (vLLM and DeepSpeed pick cuda:0 /
    cuda:LOCAL_RANK themselves; the current device is per thread). DeepSpeed insists LOCAL_RANK equals
    Open MPI's local rank, so both read 0 in this process; MPI read its own copy at start-up.
    """
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    visible = (
        os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS")
    )
    gpus = (
        visible.split(",")
        if visible
        else sorted((p.name[len("nvidia") :] for p in Path("/dev").glob("nvidia[0-9]*")), key=int)
    )
    if not gpus:
        raise RuntimeError("cluster.device=cuda but this node shows no GPU (no CUDA_VISIBLE_DEVICES, no /dev/nvidiaN)")
    first = (local * count) % len(gpus)
    if first + count > len(gpus):  # render's checks refuse such a shape under Slurm (launch/sizing.py)
        raise RuntimeError(
            f"local rank {local} with {count} GPUs (cluster.devices_per_generator) needs GPUs {first} to "
            f"{first + count - 1} but this node shows {len(gpus)}"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[first : first + count])
    os.environ["LOCAL_RANK"] = "0"
    if "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:
        os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = "0"


def job_seconds_left() -> float | None:
    """Seconds until this Slurm job's end time (squeue's %e), None outside Slurm or when unlimited."""
    import datetime
    import subprocess

    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=20)
        end = datetime.datetime.fromisoformat(out.stdout.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None  # unlimited ("N/A"), or squeue unreachable: the configured timeout stands
    return (end - datetime.datetime.now()).total_seconds()


def collective_timeout(configured_s: float, left_s: float | None) -> float:
    """The configured collective timeout, cut to end a minute before the allocation does (at least 30 s)."""
    if left_s is None:
        return configured_s
    return max(30.0, min(configured_s, left_s - 60.0))


def exit_rank(code: int = 0) -> None:
    """Flush, finalize MPI and leave at once: in interpreter teardown a torch/gloo thread can still
    drop a tensor after the GIL is gone and abort a run that ended cleanly. `code` 1: a run that ended
    cleanly but failed (rank 0's summary names why), so mpirun and srun exit non-zero."""
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = RunDir(argv[0])
    opts = argv[1:]
    # the run's marker (the launcher sets it; under srun, here), inherited by every process this rank starts
    os.environ.setdefault(MARKER, str(Path(argv[0]).resolve()))
    group = opts[opts.index("--group") + 1] if "--group" in opts else None

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    role = "rank"
    stop_requested = []
    failed = False  # rank 0: the run ended cleanly with a failure verdict (summary.json's "failure")
    try:
        from areal_hpc.config import load_config
        from areal_hpc.runtime.comm.layout import GENERATOR, SCHEDULER, TRAINER, Layout

        cfg = load_config(run_dir.config)
        if rank == 0:  # the job script's watchdog counts from the world's start: beat before the slow parts
            from areal_hpc.runtime.comm.liveness import beat_during_startup

            beat_during_startup(run_dir.heartbeat, cfg.cluster.hang_timeout_s, loop_started)
        from areal_hpc.workflow import check_user_code

        check_user_code(cfg)  # every rank imports the user's code itself, before any engine loads
        if group is not None:
            layout = Layout.from_groups(comm.allgather(group))
        else:
            layout = Layout.from_counts(cfg.cluster.n_generators, cfg.cluster.n_trainers)
        role = layout.role(rank) if rank < layout.world_size else "rank"
        _redirect_output(run_dir.rank_log(rank, role))
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s rank{rank} {role} %(name)s: %(message)s"
        )
        run_dir.rank_pid(rank).write_text(str(os.getpid()))
        layout.check(comm.Get_size(), cfg.cluster.n_generators, cfg.cluster.n_trainers)
        # a hung rank is named with its node (Slurm's name for it: virtual nodes share one hostname)
        layout = layout.with_hosts(comm.allgather(os.environ.get("SLURMD_NODENAME") or socket.gethostname()))
        # decided once, by rank 0: every rank must agree even if a shared filesystem's caches do not
        resume = comm.bcast(
            "--resume" in opts or ("--resume-auto" in opts and run_dir.latest_checkpoint() is not None), root=0
        )
        # A signal (Slurm's --signal, submitit's USR2, scancel, a terminal) asks for a checkpoint and a clean stop;
        # rank 0 acts on it, the others wait for its STOP.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, lambda *_: stop_requested.append(True))

        reward_cores = None
        if cfg.cluster.pin_roles and group is None:  # under Slurm each component's ranks are bound by srun
            from areal_hpc.runtime.cores import CoreSplit, pin_process

            split = CoreSplit.of(os.sched_getaffinity(0))
            pin_process(split.of_role(role))
            reward_cores = split.other
            logging.getLogger("areal_hpc.worker").info("pinned to cores %s", sorted(os.sched_getaffinity(0)))

        import torch

        torch.set_num_threads(cfg.cluster.threads_per_rank)
        if cfg.cluster.device == "cuda" and role != SCHEDULER:
            _pin_gpus(cfg.cluster.devices_per_generator if role == GENERATOR else 1)
        # every collective gives up before the allocation ends, so a hang there still leaves time to restart
        timeout_s = collective_timeout(cfg.sync.timeout_s, comm.bcast(job_seconds_left() if rank == 0 else None))
        in_sync = role == GENERATOR or rank == layout.trainer0
        sync_comm = comm.Split(0 if in_sync else MPI.UNDEFINED, 0 if rank == layout.trainer0 else rank)
        trainer_comm = comm.Split(1 if role == TRAINER else MPI.UNDEFINED, rank)

        from areal_hpc.model import check_model_folder

        model_dir = check_model_folder(cfg.model.path) if role != SCHEDULER else None
        sync_group = None
        if in_sync and cfg.sync.method == "broadcast":
            from areal_hpc.runtime.comm.weight_sync import SyncGroup, backend_for

            sync_group = SyncGroup(sync_comm, backend_for(cfg.sync.backend, cfg.cluster.device), timeout_s)

        if role == SCHEDULER:
            from areal_hpc.runtime.rank0.scheduler import Scheduler

            summary = Scheduler(cfg, run_dir, comm, layout, resume, lambda: bool(stop_requested)).run()
            failed = bool(summary.get("failure"))
        elif role == GENERATOR:
            from areal_hpc.runtime.generation.generator import Generator

            gen = Generator(cfg, run_dir, comm, layout, sync_group, model_dir, resume, reward_cores)
            try:
                gen.run()
            finally:
                gen.close()
        else:
            if layout.n_trainers > 1:
                from areal_hpc.runtime.comm.torch_groups import init_trainer_group

                init_trainer_group(trainer_comm, timeout_s, "nccl" if cfg.cluster.device == "cuda" else "gloo")
            from areal_hpc.runtime.training.trainer import Trainer

            tr = Trainer(cfg, run_dir, comm, layout, sync_group, model_dir, resume)
            try:
                tr.run()
            finally:
                tr.close()
        if sync_group is not None:
            sync_group.close()
        if role == TRAINER and layout.n_trainers > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
        # every rank leaves together: a polled barrier, so nobody spins on a core while waiting
        req = comm.Ibarrier()
        while not req.Test():
            time.sleep(0.005)
        logging.getLogger("areal_hpc").info("done")
    except BaseException as err:  # noqa: BLE001 - any failure must end the whole job, not hang it
        line = " ".join(f"rank {rank} ({role}) failed: {type(err).__name__}: {err}".split())
        try:
            traceback.print_exc()
            sys.stderr.flush()
            # with its kind: a start-up error that would repeat is not restarted; a lost peer's echo is no cause
            text = error_file_text(line, kind_of(err, loop_started.is_set(), (MPI.Exception,)))
            atomic_write_text(run_dir.rank_error(rank), text)
        finally:
            # MPI_Abort can hang when a peer is stopped (PMIx's abort agent times out): leave anyway, and
            # srun (--kill-on-bad-exit) or mpirun ends the rest on this rank's non-zero exit
            threading.Timer(10.0, os._exit, (1,)).start()
            comm.Abort(1)
    exit_rank(1 if failed else 0)


if __name__ == "__main__":
    main()
