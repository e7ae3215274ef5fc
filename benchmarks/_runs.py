"""What the runtime benchmarks share: one local run of the demo config with overrides, from a fresh run dir."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch_run(run_dir: Path, overrides: list[str], model_dir: Path):
    """(config, summary) of `jobs/demo.yaml` + overrides run under mpirun in `run_dir` (emptied first).

    Every run of one benchmark shares `model_dir`: the tiny model is built once, so all start equal.
    """
    from areal_hpc.config import load_config
    from areal_hpc.launch.local import launch

    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(
        ROOT / "jobs" / "demo.yaml",
        [*overrides, f"store.run_dir={run_dir}", f"model.path={model_dir}", f"run_name=bench_{run_dir.name}"],
    )
    return cfg, launch(cfg, progress=False)
