"""End-to-end: the single-process synchronous loop really learns (real model files, store, reward)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from areal_hpc.config import load_config
from areal_hpc.runtime.sync_loop import run_sync
from areal_hpc.store import Ledger, load_trajectories

DEMO = Path(__file__).resolve().parents[1] / "jobs" / "demo_sync.yaml"


@pytest.mark.slow
def test_sync_loop_learns_addition(tmp_path):
    cfg = load_config(
        DEMO,
        [
            f"store.run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            "trainer.versions=200",  # held-out 16% -> 55% on a quiet machine (60% at 250)
            "trainer.max_wall_s=0",  # versions, not seconds: a busy machine must not cut the run short
            "logging.eval_every=50",
            "logging.progress=false",
        ],
    )
    s = run_sync(cfg)
    # RL itself must add >= 20 points over the warm-started policy on held-out prompts
    assert s.acc_after - s.acc_after_warm_start >= 0.20, (s.acc_after_warm_start, s.acc_after)
    assert s.acc_before < 0.05  # random init really starts from nothing

    run = tmp_path / "run"
    metrics = pd.read_csv(run / "metrics.csv")
    assert {"version", "reward_mean", "heldout_acc", "loss", "grad_norm", "t_generate", "t_train"} <= set(
        metrics.columns
    )
    assert metrics["version"].max() == s.versions
    assert (run / "checkpoints" / f"v{s.versions:08d}" / "model.safetensors").exists()
    assert any((run / "tensorboard").iterdir())

    df = load_trajectories(run)
    # every trajectory generated was consumed exactly once, on-policy (synchronous loop)
    assert len(df) == s.versions * cfg.rollout.batch_prompts * cfg.rollout.n_samples
    assert (df["consumed_version"] >= 0).all()
    assert (df["staleness"] == 0).all()  # synchronous: every trajectory on-policy
    assert df.groupby("shard")["consumed_version"].nunique().eq(1).all()
    assert Ledger(run).last_version() == s.versions - 1
