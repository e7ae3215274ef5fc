"""Sizing checks before a job is queued: ranks against GPUs, and slurm.signal_s against one version + checkpoint."""

from __future__ import annotations

import dataclasses
import math

from areal_hpc.config import Config

# what a checkpoint write is assumed to get from a shared filesystem when nothing was measured (bytes/s)
CHECKPOINT_WRITE_BPS = 1e9
# the stop after the signal also waits for the trainers to leave the version in flight, and for srun to end
SIGNAL_MARGIN = 1.25


class SizingError(ValueError):
    """A job shape that would run wrong or lose work; one line naming the keys and what would fit."""


def tasks_per_node(tasks: int, nodes: int) -> list[int]:
    """How Slurm spreads `tasks` over `nodes` by default (block distribution): as evenly as it can, the first
    nodes one more."""
    return [tasks // nodes + (i < tasks % nodes) for i in range(nodes)]


def check_gpus(cfg: Config) -> None:
    """Every rank that uses a GPU gets one of its own (a rank takes GPU local_rank mod gpus_per_node: more ranks
    than GPUs on a node share one silently). Rank 0, the scheduler, uses none but holds local rank 0 of the
    first training node."""
    sc, cc = cfg.slurm, cfg.cluster
    if cc.device != "cuda":
        return
    if sc.gpus_per_node <= 0:
        raise SizingError("cluster.device=cuda but slurm.gpus_per_node=0: ask for the GPUs each node gives the job")
    comps = (
        ("training", 1 + cc.n_trainers, sc.train_nodes, "cluster.n_trainers", "slurm.train_nodes", 1),
        ("generation", cc.n_generators, sc.gen_nodes, "cluster.n_generators", "slurm.gen_nodes", 0),
    )
    for name, tasks, nodes, ranks_key, nodes_key, cpu_ranks in comps:
        if tasks < nodes:
            raise SizingError(f"the {name} component has {tasks} task(s) for {nodes_key}={nodes}: lower {nodes_key}")
        spread = tasks_per_node(tasks, nodes)
        busiest = max([spread[0] - cpu_ranks] + spread[1:])
        if busiest > sc.gpus_per_node:
            raise SizingError(
                f"{ranks_key}={tasks - cpu_ranks} on {nodes_key}={nodes} puts {busiest} GPU ranks on a node with "
                f"slurm.gpus_per_node={sc.gpus_per_node}: they would share GPUs; at most {nodes * sc.gpus_per_node} "
                f"fit, or add nodes"
            )


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


def check_signal(cfg: Config, version_s: float, checkpoint_bytes: float | None = None) -> None:
    """slurm.signal_s must cover the version in flight and the checkpoint after it: what the time limit's
    signal asks for before the job is killed. Without it everything since the last checkpoint is lost."""
    ckpt_s = (checkpoint_bytes or 0) / CHECKPOINT_WRITE_BPS
    need = SIGNAL_MARGIN * (version_s + ckpt_s)
    if cfg.slurm.signal_s < need:
        raise SizingError(
            f"slurm.signal_s={cfg.slurm.signal_s} is shorter than one version plus a checkpoint (~{version_s:.0f} s + "
            f"{ckpt_s:.0f} s, simulated): the time limit would lose the version in flight; set "
            f"slurm.signal_s={math.ceil(need / 60) * 60} or more"
        )


def model_checkpoint_bytes(cfg: Config) -> int | None:
    """One checkpoint's bytes, from the model folder's config.json (None before the folder exists)."""
    from areal_hpc.disk_estimate import checkpoint_bytes, read_model_shape

    try:
        shape = read_model_shape(cfg.model.path)
    except (OSError, ValueError):
        return None
    return None if shape is None else checkpoint_bytes(cfg, shape)


def check_sizing(cfg: Config) -> None:
    """Every sizing check, one SizingError line for the first that fails (render, submit and resume)."""
    check_gpus(cfg)
    if not cfg.slurm.requeue:  # no signal asked for: nothing to simulate
        return
    version_s = version_seconds(cfg)
    if version_s is not None:
        check_signal(cfg, version_s, model_checkpoint_bytes(cfg))
