"""Run directories into pandas: one run's tables, and many runs as one tidy table with their parameters as columns."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from areal_hpc.rundir import RunDir, RunDirError, SweepDir


def flatten(tree: dict, prefix: str = "") -> dict:
    """{'rollout': {'eta': 4}} -> {'rollout.eta': 4}: config keys as the overrides spell them."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass
class Run:
    """One run directory's results, read once: what every analysis function takes."""

    path: Path
    name: str
    config: dict  # dotted keys -> values, as in config.yaml
    summary: dict  # summary.json ({} while the run has not finished)
    metrics: pd.DataFrame  # metrics.csv: one row per version
    trajectories: pd.DataFrame  # one row per stored trajectory, with consumed_version and staleness
    timeline: pd.DataFrame  # every rank's events (rank, role, event, t_start, t_end, duration)
    engine: pd.DataFrame  # every generator's engine-occupancy windows


def load_run(run_dir: os.PathLike | str, name: str | None = None) -> Run:
    """Everything a finished (or running) run directory holds, as DataFrames; RunDirError if it is not one."""
    from areal_hpc.runtime.comm.timeline import load_engine_samples, load_timeline
    from areal_hpc.store import load_trajectories

    rd = RunDir(run_dir)
    if not rd.config.exists():
        raise RunDirError(f"{str(rd.root)!r} has no {rd.config.name}: not a run directory")
    config = flatten(yaml.safe_load(rd.config.read_text()) or {})
    summary = json.loads(rd.summary.read_text()) if rd.summary.exists() else {}
    metrics = pd.read_csv(rd.metrics) if rd.metrics.exists() else pd.DataFrame(columns=["version", "wall_s"])
    return Run(
        path=Path(rd.root),
        name=name or str(config.get("run_name") or Path(rd.root).name),
        config=config,
        summary=summary,
        metrics=metrics,
        trajectories=load_trajectories(rd, verify_tokens=False),
        timeline=load_timeline(Path(rd.root)),
        engine=load_engine_samples(Path(rd.root)),
    )


def varying(runs: list[Run]) -> list[str]:
    """The config keys whose values differ between the runs (a sweep's grid), in config order."""
    keys = list(dict.fromkeys(k for r in runs for k in r.config))
    skip = {"run_name", "store.run_dir"}  # differ by construction, say nothing about the run
    return [k for k in keys if k not in skip and len({repr(r.config.get(k)) for r in runs}) > 1]


def as_runs(runs) -> list[Run]:
    out = [r if isinstance(r, Run) else load_run(r) for r in runs]
    names = [r.name for r in out]
    if len(set(names)) != len(names):  # two runs with one run_name: tell them apart by folder
        for r in out:
            r.name = r.path.name if names.count(r.name) == 1 else f"{r.name}@{r.path.parent.name}/{r.path.name}"
    return out


def load_runs(runs) -> pd.DataFrame:
    """Every run's metrics as one tidy table: one row per (run, version), with a `run` column and a
    column for each config key that differs between the runs."""
    runs = as_runs(runs)
    keys = varying(runs)
    frames = []
    for r in runs:
        m = r.metrics.copy()
        m.insert(0, "run", r.name)
        for k in keys:
            m[k] = r.config.get(k)
        frames.append(m)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run", "version"])


def sweep_runs(sweep_dir: os.PathLike | str) -> list[Run]:
    """The points of a sweep (its sweep.json) that have a run directory, named by their point folder."""
    record = SweepDir(sweep_dir).record
    try:
        doc = json.loads(record.read_text())
    except FileNotFoundError:
        raise RunDirError(f"{str(sweep_dir)!r} has no {record.name}: not a sweep directory") from None
    return [
        load_run(p["run_dir"], name=Path(p["run_dir"]).name)
        for p in doc["points"]
        if RunDir(p["run_dir"]).config.exists()
    ]


def load_sweep(sweep_dir: os.PathLike | str) -> pd.DataFrame:
    """A sweep's points as `load_runs` gives them: the grid's keys are the parameter columns."""
    return load_runs(sweep_runs(sweep_dir))
