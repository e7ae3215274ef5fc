"""Sizing checks before a job is queued: ranks against GPUs; slurm.signal_s and slurm.time against a version."""

from __future__ import annotations

import dataclasses
import math

from areal_hpc.config import Config, slurm_time_minutes

# what a checkpoint write is assumed to get from a shared filesystem when nothing was measured (bytes/s)
CHECKPOINT_WRITE_BPS = 1e9
# the stop after the signal also waits for the trainers to leave the version in flight, and for srun to end
SIGNAL_MARGIN = 1.25
# start-up before a job's first version. CPU: the demo on the local Slurm cluster took 15-17 s from the job's start
# (sacct) to its first consumed batch, fresh and resumed; doubled for a busier node. GPU: not measured yet (the GPU
# path has not run): CUDA set-up, every rank loading the model, vLLM's memory profiling and DeepSpeed's set-up,
# assumed 3 minutes, plus reading the checkpoint a resume loads (at CHECKPOINT_WRITE_BPS)
CPU_START_S = 30
GPU_START_S = 180


def tasks_per_node(tasks: int, nodes: int) -> list[int]:
    """How Slurm spreads `tasks` over `nodes` by default (block distribution): as evenly as it can, the first
    nodes one more."""
    return [tasks // nodes + (i < tasks % nodes) for i in range(nodes)]


def gpu_problems(cfg: Config) -> list[str]:
    """Every rank that uses a GPU gets GPUs of its own (a rank takes GPU local_rank mod gpus_per_node, a
    generator the cluster.devices_per_generator from local_rank x that: more than a node has share silently).
    Rank 0, the scheduler, uses none but holds local rank 0 of the first training node. A generator's GPUs are
    one engine's (tensor parallel): they must all be on its node."""
    sc, cc = cfg.slurm, cfg.cluster
    if cc.device != "cuda":
        return []
    if sc.gpus_per_node <= 0:
        return ["cluster.device=cuda but slurm.gpus_per_node=0: ask for the GPUs each node gives the job"]
    devices = cc.devices_per_generator
    comps = (
        ("training", 1 + cc.n_trainers, sc.train_nodes, "cluster.n_trainers", "slurm.train_nodes", 1, 1),
        ("generation", cc.n_generators, sc.gen_nodes, "cluster.n_generators", "slurm.gen_nodes", 0, devices),
    )
    problems = []
    for name, tasks, nodes, ranks_key, nodes_key, cpu_ranks, per_rank in comps:
        if per_rank > sc.gpus_per_node:
            problems.append(
                f"cluster.devices_per_generator={per_rank} but slurm.gpus_per_node={sc.gpus_per_node}: a generator's "
                f"GPUs would span nodes; use nodes with {per_rank} GPUs or fewer devices per generator"
            )
        if tasks < nodes:
            problems.append(f"the {name} component has {tasks} task(s) for {nodes_key}={nodes}: lower {nodes_key}")
            continue
        spread = tasks_per_node(tasks, nodes)
        busiest = max([spread[0] - cpu_ranks] + spread[1:])
        if per_rank > sc.gpus_per_node or busiest * per_rank <= sc.gpus_per_node:
            continue
        each = f" x cluster.devices_per_generator={per_rank}" if per_rank > 1 else ""
        if per_rank > 1 and tasks * per_rank > nodes * sc.gpus_per_node:
            problems.append(
                f"{ranks_key}={tasks}{each} need {tasks * per_rank} GPUs but {nodes_key}={nodes} x "
                f"slurm.gpus_per_node={sc.gpus_per_node} hold {nodes * sc.gpus_per_node}: add nodes or fewer generators"
            )
        else:
            problems.append(
                f"{ranks_key}={tasks - cpu_ranks}{each} on {nodes_key}={nodes} puts {busiest} GPU ranks on a node "
                f"with slurm.gpus_per_node={sc.gpus_per_node}: they would share GPUs; at most "
                f"{nodes * (sc.gpus_per_node // per_rank)} fit, or add nodes"
            )
    return problems


def version_seconds(cfg: Config) -> float | None:
    """The simulator's time for one version of this config (its cost model is a GPU's: None on CPU runs)."""
    if cfg.cluster.device != "cuda" and cfg.rollout.engine != "emulated":
        return None
    from areal_hpc.simulate.calibrate import sim_config
    from areal_hpc.simulate.loop import simulate

    # a few versions past the first (whose queue starts empty) give the steady pace, in seconds of compute
    try:
        sim = sim_config(cfg)  # prompt lengths from the dataset, tokenized, where both are here
    except (OSError, ValueError):
        sim = sim_config(cfg, prompt_len=64)  # not on this node: the data's check comes at the job's start
    sim = dataclasses.replace(sim, versions=min(cfg.trainer.versions, 4), eval_every=0)
    r = simulate(sim)
    return r.wall_s / max(1, r.versions)


def signal_problem(cfg: Config, version_s: float, checkpoint_bytes: float | None = None) -> str | None:
    """slurm.signal_s must cover the version in flight and the checkpoint after it: what the time limit's
    signal asks for before the job is killed. Without it everything since the last checkpoint is lost."""
    ckpt_s = (checkpoint_bytes or 0) / CHECKPOINT_WRITE_BPS
    need = SIGNAL_MARGIN * (version_s + ckpt_s)
    if cfg.slurm.signal_s >= need:
        return None
    return (
        f"slurm.signal_s={cfg.slurm.signal_s} is shorter than one version plus a checkpoint (~{version_s:.0f} s + "
        f"{ckpt_s:.0f} s, simulated): the time limit would lose the version in flight; set "
        f"slurm.signal_s={math.ceil(need / 60) * 60} or more"
    )


def time_problem(cfg: Config, version_s: float | None, checkpoint_bytes: float | None = None) -> str | None:
    """slurm.time must leave room before the signal for start-up, one version and its checkpoint: a shorter
    time limit signals a job before it has made progress, and it checkpoints and requeues for ever."""
    slurm_cfg = cfg.slurm
    limit_s = slurm_time_minutes(slurm_cfg.time) * 60
    if not slurm_cfg.requeue or limit_s == 0:  # no signal is asked for; time=0 is no limit
        return None
    ckpt_s = (checkpoint_bytes or 0) / CHECKPOINT_WRITE_BPS
    start_s = GPU_START_S + ckpt_s if cfg.cluster.device == "cuda" else CPU_START_S  # a resume reads its checkpoint
    work_s = SIGNAL_MARGIN * ((version_s or 0) + ckpt_s)
    need = slurm_cfg.signal_s + start_s + work_s
    if limit_s > need:
        return None
    # what fits with the signal this config also needs (signal_problem asks for at least work_s)
    signal = max(slurm_cfg.signal_s, math.ceil(work_s / 60) * 60 if version_s is not None else 0)
    fit = math.floor((signal + start_s + work_s) / 60) + 1
    work = f" and ~{work_s:.0f} s for one version and its checkpoint (simulated)" if version_s is not None else ""
    with_signal = f" with slurm.signal_s={signal}" if signal != slurm_cfg.signal_s else ""
    return (
        f"slurm.time={slurm_cfg.time} leaves no room before slurm.signal_s={slurm_cfg.signal_s}: "
        f"the job needs ~{start_s:.0f} s "
        f"to start{work} before the signal, or it requeues without progress; set "
        f"slurm.time={fit // 60:02d}:{fit % 60:02d}:00 or more{with_signal}"
    )


def model_checkpoint_bytes(cfg: Config) -> int | None:
    """One checkpoint's bytes, from the model folder's config.json (None before the folder exists)."""
    from areal_hpc.disk_estimate import checkpoint_bytes, read_model_shape

    try:
        shape = read_model_shape(cfg.model.path)
    except (OSError, ValueError):
        return None
    return None if shape is None else checkpoint_bytes(cfg, shape)


def sizing_problems(cfg: Config) -> list[str]:
    """Every sizing problem, one line each: GPUs per rank, and with a time-limit signal, slurm.signal_s against
    one version + checkpoint (simulated for GPU configs) and slurm.time against slurm.signal_s."""
    return gpu_problems(cfg) + timing_problems(cfg)


def timing_problems(cfg: Config) -> list[str]:
    """slurm.signal_s against one version + checkpoint, and slurm.time against slurm.signal_s (a sweep's points,
    one allocation each, need these too)."""
    problems: list[str] = []
    if not cfg.slurm.requeue:  # no signal asked for: nothing to simulate
        return problems
    version_s, ckpt = version_seconds(cfg), model_checkpoint_bytes(cfg)
    if version_s is not None and (problem := signal_problem(cfg, version_s, ckpt)) is not None:
        problems.append(problem)
    if (problem := time_problem(cfg, version_s, ckpt)) is not None:
        problems.append(problem)
    return problems
