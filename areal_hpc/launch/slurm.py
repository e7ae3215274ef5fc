"""Slurm: render the heterogeneous-job sbatch script, check a request against the cluster, job state."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jinja2

from areal_hpc.config import Config, SlurmConfig, load_config, to_yaml
from areal_hpc.engines import EngineNotInstalled, require_installed
from areal_hpc.launch.environment import RANK_ENV, slurm_job_id
from areal_hpc.rundir import RunDir
from areal_hpc.trackers import TrackerNotInstalled, require_trackers

TEMPLATES = Path(__file__).resolve().parents[2] / "slurm_templates"
HETJOB_TEMPLATE = "areal_hetjob.sbatch.j2"
SHARED_FS = {
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "beegfs",
    "cephfs",
    "ceph",
    "fuse.glusterfs",
    "glusterfs",
    "panfs",
    "wekafs",
    "fuse.sshfs",
    "cifs",
    "smb2",
    "9p",
    "virtiofs",
}


class SlurmError(RuntimeError):
    """A Slurm request that cannot work; the message is one line naming what and what is allowed."""


def slurm_command(cmd: list[str], timeout: float = 30) -> str:
    """Run a Slurm (or findmnt) command and return its stdout; SlurmError with one line if it fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(
            f"{cmd[0]} is not on PATH: is this a Slurm login node? (locally: bash env/slurm-up.sh)"
        ) from None
    if out.returncode != 0:
        msg = " ".join((out.stderr or out.stdout).split()) or f"exit code {out.returncode}"
        raise SlurmError(f"{' '.join(cmd[:2])} failed: {msg}")
    return out.stdout


def job_venv(cfg: Config) -> str:
    """The venv a job activates: slurm.venv, else the one this command runs in ('' outside a venv)."""
    return cfg.slurm.venv or (sys.prefix if sys.prefix != sys.base_prefix else "")


def component_options(sc: SlurmConfig, devices_per_task: int = 1) -> list[str]:
    """The sbatch options each component of the job repeats (a het job's components do not share them).

    `devices_per_task`: the devices each of the component's tasks drives (a generator's engine spans
    cluster.devices_per_generator): its CPUs cover that many workers. GPUs come as the component's shape,
    --gpus-per-node in both components, not --gpus-per-task: every rank then takes its GPUs of its node by
    its local rank (a generator k its N GPUs from k x N: runtime/worker.py), one rule for trainers and
    generators that does not depend on how a site binds GPUs to tasks; render's checks make the shape hold
    every generator's N GPUs on one node (sizing.gpu_problems).
    """
    opts = [
        f"--{k}={v}"
        for k, v in (
            ("partition", sc.partition),
            ("account", sc.account),
            ("qos", sc.qos),
            ("constraint", sc.constraint),
        )
        if v
    ]
    opts.append(f"--cpus-per-task={sc.cpus_per_task * devices_per_task}")
    if sc.gpus_per_node:
        opts.append(f"--gpus-per-node={sc.gpus_per_node}")
    if sc.mem:
        opts.append(f"--mem={sc.mem}")
    return opts + list(sc.extra_sbatch)


def render_sbatch(cfg: Config, source: str = "") -> str:
    """The sbatch script for this config: readable, and runs as is with plain `sbatch`."""
    slurm_cfg = cfg.slurm
    run_dir = Path(cfg.store.run_dir).resolve()
    resolved = _as_rendered(cfg, RunDir(run_dir))
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    env.filters["shell"] = lambda s: shlex.quote(str(s))
    return env.get_template(HETJOB_TEMPLATE).render(
        run_name=cfg.run_name,
        job_name=f"areal-{cfg.run_name}",
        run_dir=str(run_dir),
        source=source or "<config>",
        n_trainers=cfg.cluster.n_trainers,
        n_generators=cfg.cluster.n_generators,
        devices_per_generator=cfg.cluster.devices_per_generator,
        gpus=slurm_cfg.gpus_per_node > 0,
        train_nodes=slurm_cfg.train_nodes,
        gen_nodes=slurm_cfg.gen_nodes,
        time=slurm_cfg.time,
        requeue=slurm_cfg.requeue,
        signal_s=slurm_cfg.signal_s,
        max_restarts=slurm_cfg.max_restarts,
        hang_timeout_s=int(math.ceil(cfg.cluster.hang_timeout_s)),
        train_options=component_options(slurm_cfg),
        gen_options=component_options(slurm_cfg, cfg.cluster.devices_per_generator),
        setup=list(slurm_cfg.setup),
        venv=job_venv(cfg),
        config_yaml=to_yaml(resolved),
        paths=RunDir(run_dir),
        rank_env=RANK_ENV,
        mpi=slurm_cfg.mpi,
    )


# -- checks before anything is queued ------------------------------------------------------------------
def render_target_problem(cfg: Config) -> str | None:
    """A rendered script writes its config only where none is (so a requeue finds its run): rendering a different
    config over a run would be silently ignored. Point to resume instead."""
    run = RunDir(Path(cfg.store.run_dir).resolve())
    if run.holds_run() or (run.config.is_file() and run.config.read_text() != to_yaml(_as_rendered(cfg, run))):
        return (
            f"run dir {str(run.root)!r} already holds a run; to go on with it: areal-hpc resume {run.root} "
            "[KEY=VALUE ...]; for a new run pick another run_name=... or store.run_dir=..."
        )
    # a script rendered earlier and still queued has written nothing yet: a second job would share the folder
    if run.logs.is_dir() and which_slurm() and (job := queued_job(run.root)) is not None:
        return (
            f"job {job} of run dir {str(run.root)!r} is still queued; cancel it (areal-hpc cancel {run.root}) "
            "before rendering another, or pick another run_name=... or store.run_dir=..."
        )
    return None


def _as_rendered(cfg: Config, run: RunDir) -> Config:
    resolved = copy.deepcopy(cfg)
    resolved.store.run_dir = str(run.root)
    return resolved


@dataclass
class PartitionInfo:
    name: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    hosts: set[str]


def partition_info(partition: str = "") -> PartitionInfo:
    """Nodes, CPUs and GPUs of a partition ('' = the default one), from sinfo/scontrol."""
    out = slurm_command(["sinfo", "-h", "-N", "-o", "%R|%N|%c|%G|%P"])
    rows = [ln.split("|") for ln in out.splitlines() if ln.strip()]
    names = {r[0] for r in rows}
    if not partition:
        default = [r[4].rstrip("*") for r in rows if r[4].endswith("*")]
        if not default:
            raise SlurmError("the cluster has no default partition; set slurm.partition")
        partition = default[0]
    elif partition not in names:
        raise SlurmError(f"slurm.partition={partition!r} does not exist; partitions here: {', '.join(sorted(names))}")
    mine = [r for r in rows if r[0] == partition]
    gpus = 0
    for r in mine:
        m = re.search(r"gpu(?::[^:,()]+)?:(\d+)", r[3])
        gpus = max(gpus, int(m.group(1)) if m else 0)
    node_names = sorted({r[1] for r in mine})
    hosts = set()
    for line in slurm_command(["scontrol", "show", "node", ",".join(node_names), "-o"]).splitlines():
        m = re.search(r"NodeHostName=(\S+)", line)
        if m:
            hosts.add(m.group(1))
    return PartitionInfo(partition, len(node_names), min(int(r[2]) for r in mine), gpus, hosts)


def _fs_type(path: Path) -> str:
    """The mount table's filesystem type (nfs4, lustre, fuse.glusterfs, ...) of the nearest existing folder."""
    p = path
    while not p.exists():
        p = p.parent
    return slurm_command(["findmnt", "-n", "-o", "FSTYPE", "-T", str(p)]).strip()


def check_request(cfg: Config, het: bool = True) -> PartitionInfo:
    """One SlurmError line for the first impossible request (request_problems lists them all)."""
    part, problems = request_problems(cfg, het)
    if problems:
        raise SlurmError(problems[0])
    return part


def request_problems(cfg: Config, het: bool = True) -> tuple[PartitionInfo | None, list[str]]:
    """One clear line per impossible request, before anything is queued (het=False: one allocation for all ranks).
    No partition (it does not exist): the checks against its nodes are left out."""
    from areal_hpc.model import ModelFolderError, check_model_folder
    from areal_hpc.model.teacher import teacher_problem

    sc, problems = cfg.slurm, []
    try:
        part = partition_info(sc.partition)
    except SlurmError as err:
        part = None
        problems.append(str(err))
    nodes = sc.train_nodes + sc.gen_nodes
    if part is not None and nodes > part.nodes:
        problems.append(
            f"the job asks for {nodes} nodes (slurm.train_nodes={sc.train_nodes} + slurm.gen_nodes="
            f"{sc.gen_nodes}) but partition {part.name!r} has {part.nodes}"
        )
    # a generator's task holds CPUs for each of its devices' workers; a homogeneous step (het=False) gives
    # every task what a generator's needs
    devices, cpus = cfg.cluster.devices_per_generator, sc.cpus_per_task
    gen_what = f"slurm.cpus_per_task={cpus}" + (f" x cluster.devices_per_generator={devices}" if devices > 1 else "")
    comps = (
        ("training", 1 + cfg.cluster.n_trainers, sc.train_nodes, cpus, f"slurm.cpus_per_task={cpus}"),
        ("generation", cfg.cluster.n_generators, sc.gen_nodes, cpus * devices, gen_what),
    )
    if not het:
        comps = (("job", 1 + cfg.cluster.n_trainers + cfg.cluster.n_generators, nodes, cpus * devices, gen_what),)
    for comp, tasks, n, task_cpus, what in comps if part is not None else ():
        per_node = part.cpus_per_node // task_cpus  # a task's CPUs must all be on one node
        if tasks > n * per_node:
            problems.append(
                f"the {comp} component needs {tasks} tasks x {what} CPUs "
                f"but {n} node(s) of {part.name!r} ({part.cpus_per_node} CPUs each) fit {n * per_node} such tasks"
            )
    if part is not None and sc.gpus_per_node > part.gpus_per_node:
        problems.append(
            f"slurm.gpus_per_node={sc.gpus_per_node} but nodes of partition {part.name!r} "
            f"have {part.gpus_per_node} GPUs"
        )
    run_dir = Path(cfg.store.run_dir).resolve()
    if any(c.isspace() for c in str(run_dir)):
        problems.append(
            f"store.run_dir={str(run_dir)!r} contains whitespace, which #SBATCH lines cannot carry; pick a path without"
        )
    local_only = part is None or part.hosts <= {os.uname().nodename.split(".")[0], os.uname().nodename}
    if nodes > 1 and not local_only and (fs := _fs_type(run_dir)) not in SHARED_FS:
        problems.append(
            f"store.run_dir={str(run_dir)!r} is on a local filesystem ({fs}); with {nodes} nodes it must be "
            f"on a shared one ({', '.join(sorted(SHARED_FS)[:6])}, ...)"
        )
    if not sc.venv or Path(sc.venv).resolve() == Path(sys.prefix).resolve():  # else the nodes' venv may differ
        try:
            require_installed(cfg.rollout.engine, cfg.trainer.engine)
            require_trackers(cfg.logging.trackers)
        except (EngineNotInstalled, TrackerNotInstalled) as err:
            problems.append(str(err))
    if not cfg.model.build_tiny:
        try:
            check_model_folder(cfg.model.path)
        except ModelFolderError as err:
            problems.append(str(err).splitlines()[0])
    if why := teacher_problem(cfg.distill.teacher):  # its tokenizer is compared with the student's at start-up
        problems.append(why)
    return part, problems


def prepare_run_dir(run_dir: Path) -> str:
    """Run by the batch script before srun: model folder ready, no stale stop request; says fresh or resume."""
    from areal_hpc.runtime.startup_checks import check_start, record_start

    run = RunDir(run_dir)
    cfg = load_config(run.config)
    if job_id := slurm_job_id():  # a sweep's point as JOBID_TASK; saved first: a start refused below is this job's
        info = {"submitted_by": "sbatch"}  # unless submit or resume said otherwise (submitit): resume goes the same way
        try:
            info |= load_job(run_dir)
        except SlurmError:
            pass
        save_job(run_dir, info | {"job_id": job_id})
    n = run.latest_checkpoint()
    # one line in the job's log before srun starts any rank (CheckpointError, a ValueError, on a damaged one);
    # the user's code imports here as it will on every node
    check_start(cfg, run.root, resume=n is not None)
    record_start(run, cfg)
    if n is not None:
        return f"resuming {run_dir} from checkpoint v{n}"
    if run.rollouts.exists() or run.ledger.exists():
        # a start that died before its first checkpoint: nothing was trained; keep it aside
        aside = run.discarded()
        aside.mkdir()
        for p in (run.rollouts, run.ledger, run.metrics, run.timeline, run.checkpoints):
            if p.exists():
                os.replace(p, aside / p.name)
        return f"starting {run_dir} afresh (an earlier start without a checkpoint moved to {aside.name})"
    return f"starting {run_dir}"


# -- job state ----------------------------------------------------------------------------------------
def save_job(run_dir: Path, info: dict) -> None:
    from areal_hpc.utils import atomic_write_text

    path = RunDir(run_dir).job_file
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(info, indent=1))


def load_job(run_dir: Path) -> dict:
    """The run's job: slurm/job.json (written at submission by submit and resume, and by the job when it starts),
    else a queued job whose output goes to this run's logs (a rendered script submitted with plain sbatch)."""
    path = RunDir(run_dir).job_file
    if path.exists():
        return json.loads(path.read_text())
    queued = queued_job(run_dir)
    if queued is None:
        raise SlurmError(
            f"no job of the run in {str(run_dir)!r}: it was not submitted yet (areal-hpc submit, or areal-hpc "
            "render then sbatch), or its job left the queue before it started"
        )
    return {"job_id": queued, "submitted_by": "sbatch"}


def queued_job(run_dir: Path) -> str | None:
    """The id of the newest job in the queue that writes its Slurm output into RUN_DIR/logs (None if none)."""
    logs = RunDir(Path(run_dir).resolve()).logs
    mine = [job_id for job_id, _, out in queued_jobs() if out is not None and out.parent == logs]
    return mine[-1] if mine else None


def queued_jobs(also: set[str] = frozenset()) -> list[tuple[str, str, Path | None]]:
    """(job id, state, output file) of this user's areal jobs in the queue, and of the jobs in `also`, oldest
    first (scontrol's view: a job that left the queue is not listed)."""
    out = slurm_command(["squeue", "-h", "--me", "-o", "%i|%j"])
    ids = {ln.split("|")[0].split("+")[0] for ln in out.splitlines() if "|areal-" in ln} | set(also)
    found = []
    for job_id in ids:
        show = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        out_file, state = re.search(r"StdOut=(\S+)", show), re.search(r"JobState=(\S+)", show)
        if state is not None:
            found.append((job_id, state.group(1), Path(out_file.group(1)) if out_file else None))
    return sorted(found, key=lambda j: int(re.sub(r"\D.*", "", j[0]) or 0))


def pending_reason(job_id: str) -> str:
    """Why Slurm has not started a pending job yet (squeue's reason: Priority, Resources, JobHeldUser, ...)."""
    out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%r"], capture_output=True, text=True).stdout
    return (out.split() or ["unknown"])[0]


def job_state(job_id: str) -> str:
    """Slurm's state of a (het) job from sacct: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ..."""
    out = slurm_command(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,State"])
    states = [ln.split("|")[1].split()[0] for ln in out.splitlines() if ln.strip()]
    if not states:  # not in accounting yet: ask the controller
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True)
        return (out.stdout.split() or ["UNKNOWN"])[0]
    for worst in (
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "TIMEOUT",
        "CANCELLED",
        "PREEMPTED",
        "REQUEUED",
        "RUNNING",
        "PENDING",
        "COMPLETED",
    ):
        if worst in states:
            return worst
    return states[0]


def wait_for(job_id: str, states: set[str], timeout_s: float, poll_s: float = 0.5) -> str:
    end = time.time() + timeout_s
    while True:
        st = job_state(job_id)
        if st in states or time.time() > end:
            return st
        time.sleep(poll_s)


def cancel(job_id: str) -> None:
    slurm_command(["scancel", str(job_id)])


def which_slurm() -> bool:
    return shutil.which("sbatch") is not None
