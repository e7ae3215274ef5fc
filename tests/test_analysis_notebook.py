"""The analysis notebook's code runs against a real (small) run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]


def test_run_overview_notebook_executes(tmp_path, tiny_model_dir):
    from areal_hpc.config import load_config
    from areal_hpc.runtime.sync_loop import run_sync

    run = tmp_path / "runs" / "demo_sync"
    cfg = load_config(
        ROOT / "jobs" / "demo_sync.yaml",
        [
            f"store.run_dir={run}",
            f"model.path={tiny_model_dir}",
            "trainer.versions=3",
            "trainer.warm_start_steps=2",
            "logging.eval_prompts=20",
            "logging.progress=false",
        ],
    )
    run_sync(cfg)
    # the synchronous loop writes the asynchronous runtime's gap columns; every token is staleness 0 here
    import pandas as pd

    from areal_hpc.algo.mismatch import FIGURES, SETS

    trained = pd.read_csv(run / "metrics.csv").query("version > 0")
    assert (trained["mismatch_tokens"] == trained["offpolicy_tokens"]).all()
    measured = trained[trained["offpolicy_tokens"] > 0]  # a version whose groups all scored alike trains nothing
    gap = [f"{name}_{k}" for name in SETS for k in FIGURES]
    assert len(measured) >= 1 and measured[gap].notna().all().all(), trained
    figures = [c for c in gap if not c.endswith("_tokens")]
    assert trained.loc[trained["offpolicy_tokens"] == 0, figures].isna().all().all()  # an empty cell, not a 0
    assert not any("_sums/" in c for c in trained.columns)  # the trainer's sums are merged, not copied
    nb = json.loads((ROOT / "analysis" / "run_overview.ipynb").read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    (tmp_path / "analysis").mkdir()
    os.chdir(tmp_path / "analysis")  # the notebook names the run relative to analysis/
    scope: dict = {}
    for src in code:
        exec(compile(src, "run_overview.ipynb", "exec"), scope)
    assert len(scope["metrics"]) == 4 and len(scope["traj"]) == 3 * 32 * 8
