"""Sweeps: a grid of config overrides submitted as one Slurm job array, and a DataFrame of the results."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pandas as pd
import submitit

from areal_hpc.config import Config, load_config
from areal_hpc.launch.sizing import timing_problems
from areal_hpc.launch.slurm import SlurmError, check_request, job_state
from areal_hpc.launch.submit import AsyncRun, forget_run_dir, make_executor, new_run_dir, record_job, srun_command
from areal_hpc.rundir import RunDir, SweepDir
from areal_hpc.utils import atomic_write_text


def grid_points(grid: dict[str, list]) -> list[dict]:
    """Every combination of the grid's values, in a stable order."""
    if not grid:
        raise ValueError("a sweep needs a grid, e.g. {'rollout.eta': [0, 4]}")
    keys = list(grid)
    for k in keys:
        if not isinstance(grid[k], (list, tuple)) or not grid[k]:
            raise ValueError(f"sweep grid {k!r} must be a non-empty list of values")
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def _point_name(i: int, params: dict) -> str:
    tag = ",".join(f"{k.split('.')[-1]}={v}" for k, v in params.items())
    return f"p{i:03d}-{tag}".replace("/", "_")[:120]


def sweep(
    base_config: str | Path,
    grid: dict[str, list],
    sweep_dir: str | Path,
    overrides: list[str] | None = None,
    max_parallel: int | None = None,
) -> list:
    """Submit one run per grid point as a Slurm job array (submitit's map_array).

    Each point gets RUN_DIR = sweep_dir/p{i}-{params}. Slurm has no heterogeneous job arrays, so each
    array task is one homogeneous allocation holding every rank (roles from the config's counts).
    Returns submitit's jobs; `collect(sweep_dir)` gives the results as a DataFrame.
    """
    sweep_dir = SweepDir(Path(sweep_dir).resolve())
    if sweep_dir.record.exists():
        raise SlurmError(f"sweep dir {str(sweep_dir.root)!r} already holds a sweep; pick another")
    points = grid_points(grid)
    shaped = [k for k in grid if k.startswith(("cluster.", "slurm."))]
    if shaped:  # one array = one resource request for every task
        raise SlurmError(
            f"sweep grid key {shaped[0]!r} changes the job's shape; an array shares one shape "
            "(sweep it as separate submits)"
        )
    cfgs: list[Config] = []
    for i, params in enumerate(points):
        ov = [
            *(overrides or []),
            *(f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in params.items()),
            f"store.run_dir={sweep_dir.point(_point_name(i, params)).root}",
        ]
        cfgs.append(load_config(base_config, ov))
    for cfg in cfgs:  # every point is checked before anything is queued
        check_request(cfg, het=False)
        if timing := timing_problems(cfg):
            raise SlurmError(timing[0])
    run_dirs = [new_run_dir(cfg) for cfg in cfgs]
    ex = make_executor(cfgs[0], sweep_dir.submitit, het=False, array_parallelism=max_parallel or len(cfgs))
    calls = [AsyncRun(str(d), srun_command(cfg, d, het=False)) for cfg, d in zip(cfgs, run_dirs)]
    try:
        jobs = ex.submit_array(calls)
    except submitit.core.utils.FailedJobError as err:
        for d in run_dirs:
            forget_run_dir(d)
        raise SlurmError(f"sbatch refused the array: {' '.join(str(err).split())[-300:]}") from None
    for d, j in zip(run_dirs, jobs):  # each point answers `areal-hpc status` like a submitted run
        record_job(d, j, sweep_dir.submitit)
    doc = {
        "base_config": str(base_config),
        "grid": grid,
        "overrides": overrides or [],
        "points": [{"params": p, "run_dir": str(d), "job_id": j.job_id} for p, d, j in zip(points, run_dirs, jobs)],
    }
    atomic_write_text(sweep_dir.record, json.dumps(doc, indent=1))
    return jobs


def collect(sweep_dir: str | Path) -> pd.DataFrame:
    """One row per grid point: its parameters, Slurm status, throughput, final accuracy, wall time."""
    record = SweepDir(sweep_dir).record
    try:
        doc = json.loads(record.read_text())
    except FileNotFoundError:
        raise SlurmError(f"{str(sweep_dir)!r} has no {record.name}: not a sweep dir") from None
    rows = []
    for p in doc["points"]:
        summary_path = RunDir(p["run_dir"]).summary
        s = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        try:
            status = job_state(p["job_id"])
        except SlurmError:
            status = "UNKNOWN"
        rows.append(
            {
                **p["params"],
                "status": status,
                "job_id": p["job_id"],
                "run_dir": p["run_dir"],
                "versions": s.get("versions"),
                "consumed_tokens_per_s": s.get("consumed_tokens_per_s"),
                "acc_start": s.get("acc_start"),
                "acc_final": s.get("acc_final"),
                "heldout_reward_mean_final": s.get("heldout_reward_mean_final"),  # the final evaluation's mean reward
                "wall_s": s.get("wall_s"),
                "rl_wall_s": s.get("rl_wall_s"),
            }
        )
    return pd.DataFrame(rows)
