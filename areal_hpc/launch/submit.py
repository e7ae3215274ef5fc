"""Submit a run as a heterogeneous Slurm job through submitit (its executor, folder and log conventions)."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import submitit

from areal_hpc.config import Config, slurm_time_minutes
from areal_hpc.launch.environment import rank_env
from areal_hpc.launch.slurm import SlurmError, component_options, job_venv, prepare_run_dir, save_job
from areal_hpc.rundir import RunDir, RunDirError
from areal_hpc.rundir.actions import create


def srun_command(cfg: Config, run_dir: Path, het: bool = True, python: str = sys.executable) -> list[str]:
    """Every rank as one MPI world, started from inside the job (by the first task of component 0).

    het=False is for job arrays (Slurm has no heterogeneous job arrays): one homogeneous allocation,
    roles from the config's counts.
    """
    worker = [python, "-m", "areal_hpc.runtime.worker", str(run_dir), "--resume-auto"]
    cpus = f"--cpus-per-task={cfg.slurm.cpus_per_task}"
    # a generator's task holds CPUs for each of its devices' workers (tensor parallel)
    gen_cpus = f"--cpus-per-task={cfg.slurm.cpus_per_task * cfg.cluster.devices_per_generator}"
    # --overlap: this step shares CPUs with the submitit task that launches it
    srun = ["srun", f"--mpi={cfg.slurm.mpi}", "--kill-on-bad-exit=1", "--overlap"]
    if not het:  # one step, one task size: every task as large as a generator's
        world = 1 + cfg.cluster.n_generators + cfg.cluster.n_trainers
        return [*srun, f"--ntasks={world}", gen_cpus, *worker]
    return [
        *srun,
        "--het-group=0",
        f"--ntasks={1 + cfg.cluster.n_trainers}",
        cpus,
        *worker,
        "--group",
        "train",
        ":",
        "--het-group=1",
        f"--ntasks={cfg.cluster.n_generators}",
        gen_cpus,
        *worker,
        "--group",
        "gen",
    ]


def _file_stamp(path: Path) -> tuple[int, int] | None:
    """(inode, mtime in ns) of a file, None if absent: changes when the file is replaced (atomic write)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


class AsyncRun(submitit.helpers.Checkpointable):
    """What submitit runs: prepare the run dir, srun every rank, return summary.json.

    On submitit's pre-timeout / preemption signal, `checkpoint` asks rank 0 to checkpoint and stop,
    waits for the ranks, and hands submitit the same run to requeue; it resumes from the checkpoint.
    """

    def __init__(self, run_dir: str, cmd: list[str], grace_s: float = 60.0, exit_grace_s: float = 60.0):
        self.run_dir, self.cmd, self.grace_s, self.exit_grace_s = run_dir, cmd, grace_s, exit_grace_s
        self._proc: subprocess.Popen | None = None

    def __call__(self) -> dict:
        if int(os.environ.get("SLURM_PROCID", "0")) != 0:
            return {}  # one launcher per job: component 0's other tasks have nothing to do
        from areal_hpc.launch.environment import slurm_job_id
        from areal_hpc.launch.jobs import take_claim

        # one job per run dir; a sweep's point claims as JOBID_TASK, the id its job.json and status give
        if refused := take_claim(self.run_dir, slurm_job_id()):
            raise RuntimeError(refused)
        print(f"[areal] {prepare_run_dir(Path(self.run_dir))}", flush=True)
        self._proc = subprocess.Popen(self.cmd, env=rank_env())
        run = RunDir(self.run_dir)
        before, finished_at, erred_at = _file_stamp(run.summary), None, None  # a requeued run has an older summary
        # poll, not wait(): a blocking wait() would keep checkpoint() (a signal handler) from reaping srun
        while (rc := self._proc.poll()) is None:
            time.sleep(0.5)
            if finished_at is None and _file_stamp(run.summary) not in (None, before):
                finished_at = time.time()  # rank 0 of this launch wrote it
            if erred_at is None and run.rank_errors():  # prepare removed the last launch's
                erred_at = time.time()
            # Seen once in CI: both het components' steps ended, yet srun never returned. A finished run
            # (rank 0 writes summary.json last) or a dead one (a rank wrote its error, then aborted) must not
            # hold the allocation: srun gets a grace, then is ended (the batch script does the same).
            since = finished_at if finished_at is not None else erred_at
            if since is not None and time.time() - since > self.exit_grace_s:
                why = "the run finished" if finished_at is not None else "a rank failed"
                print(
                    f"[areal] srun still running {self.exit_grace_s:.0f} s after {why}; ending it",
                    file=sys.stderr,
                    flush=True,
                )
                self._proc.terminate()
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                rc = 0 if finished_at is not None else 1
                break
        if rc != 0:
            from areal_hpc.launch.local import failure_line

            raise RuntimeError(failure_line(Path(self.run_dir), rc))
        return json.loads(run.summary.read_text())

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        RunDir(self.run_dir).stop.touch()
        if self._proc is not None:
            end = time.time() + self.grace_s
            while self._proc.poll() is None and time.time() < end:
                time.sleep(0.5)
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
        return submitit.helpers.DelayedSubmission(AsyncRun(self.run_dir, self.cmd, self.grace_s, self.exit_grace_s))


def make_executor(
    cfg: Config, folder: Path, het: bool = True, array_parallelism: int | None = None
) -> submitit.AutoExecutor:
    """A submitit executor for component 0; component 1 (the generators) is added by `#SBATCH hetjob` lines
    written where sbatch still reads them (submitit has no heterogeneous-job API). het=False: one
    homogeneous allocation for every rank (job arrays)."""
    slurm_cfg = cfg.slurm
    comp0_extra = [
        f"#SBATCH {opt}" for opt in slurm_cfg.extra_sbatch
    ]  # before "hetjob": component 0's (or the array's)
    comp1 = []
    if het:
        comp1 = [
            "#SBATCH hetjob",
            f"#SBATCH --nodes={slurm_cfg.gen_nodes}",
            f"#SBATCH --ntasks={cfg.cluster.n_generators}",
        ]
        comp1 += [f"#SBATCH {opt}" for opt in component_options(slurm_cfg, cfg.cluster.devices_per_generator)]
    venv = job_venv(cfg)
    setup = comp0_extra + comp1 + list(slurm_cfg.setup) + ([f"source {shlex.quote(venv)}/bin/activate"] if venv else [])
    # a long run is cut into many time slices: keep requeueing it (submitit's default stops after 3)
    ex = submitit.AutoExecutor(folder=str(folder), cluster="slurm", slurm_max_num_timeout=10_000)
    extra = {
        k: v
        for k, v in (("account", slurm_cfg.account), ("qos", slurm_cfg.qos), ("constraint", slurm_cfg.constraint))
        if v
    }
    ranks = 1 + cfg.cluster.n_trainers + (0 if het else cfg.cluster.n_generators)
    nodes = slurm_cfg.train_nodes + (0 if het else slurm_cfg.gen_nodes)
    # the homogeneous step gives every rank a generator's CPUs (srun_command)
    rank_cpus = slurm_cfg.cpus_per_task * (1 if het else cfg.cluster.devices_per_generator)
    params = dict(
        name=f"areal-{cfg.run_name}",
        timeout_min=max(1, math.ceil(slurm_time_minutes(slurm_cfg.time))),
        nodes=nodes,
        tasks_per_node=1,
        cpus_per_task=-(-ranks // nodes) * rank_cpus,
        slurm_setup=setup,
        slurm_additional_parameters=extra,
        slurm_signal_delay_s=max(slurm_cfg.signal_s, 1),
    )
    if slurm_cfg.partition:
        params["slurm_partition"] = slurm_cfg.partition
    if slurm_cfg.gpus_per_node:
        params["slurm_gpus_per_node"] = slurm_cfg.gpus_per_node
    if slurm_cfg.mem:
        params["slurm_mem"] = slurm_cfg.mem
    if array_parallelism:
        params["slurm_array_parallelism"] = array_parallelism
    ex.update_parameters(**params)
    return ex


def forget_run_dir(run_dir: Path) -> None:
    """Undo new_run_dir after a refused submission (only what it and submitit wrote)."""
    import shutil

    run = RunDir(run_dir)
    for p in (run.config, run.logs, run.slurm):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    try:
        run.root.rmdir()
    except OSError:
        pass


def new_run_dir(cfg: Config) -> Path:
    """Create RUN_DIR with its resolved config (refusing one that holds a run)."""
    from areal_hpc.launch.local import RunFailed

    root = Path(cfg.store.run_dir).resolve()
    hint = f"to go on with it: areal-hpc resume {root}; for a new run pick another run_name=... or store.run_dir=..."
    try:
        return create(RunDir(root), cfg, queued=True, hint=hint).root
    except RunDirError as err:
        raise RunFailed(str(err)) from None


def submit(cfg: Config) -> submitit.Job:
    """Check the request, create RUN_DIR and submit; returns submitit's Job (job.job_id, job.result())."""
    from areal_hpc.launch.request_checks import check_all

    check_all(cfg, "submit")  # every problem of the request at once
    run_dir = new_run_dir(cfg)
    try:
        return queue(cfg, run_dir)
    except SlurmError:
        forget_run_dir(run_dir)  # nothing was queued: let the user fix the request and submit again
        raise


def queue(cfg: Config, run_dir: Path) -> submitit.Job:
    """Queue the run in RUN_DIR (new, or resumed from its checkpoint) through submitit; record its job id."""
    folder = RunDir(run_dir).submitit
    ex = make_executor(cfg, folder)
    try:
        job = ex.submit(AsyncRun(str(run_dir), srun_command(cfg, run_dir)))
    except submitit.core.utils.FailedJobError as err:
        raise SlurmError(f"sbatch refused the job: {' '.join(str(err).split())[-300:]}") from None
    record_job(run_dir, job, folder)
    return job


def record_job(run_dir: Path, job: submitit.Job, folder: Path) -> None:
    """RUN_DIR's slurm/job.json for a job submitit queued: `areal-hpc status` and `cancel` read it."""
    save_job(
        run_dir, {"job_id": job.job_id, "submitted_by": "submitit", "submitit_folder": str(folder), "time": time.time()}
    )
