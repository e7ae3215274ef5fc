"""End to end under mpirun: user code from files outside the package, and multi-turn episodes across weight loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from test_runtime import _audit

from areal_hpc.config import load_config
from areal_hpc.launch.local import launch
from areal_hpc.model import load_tokenizer
from areal_hpc.store import list_shards, read_shard
from areal_hpc.workflow.runner import render_turn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "jobs" / "examples" / "custom.yaml"


def _trajectories(run: Path) -> list:
    return [t for p in list_shards(run / "rollouts") for t in read_shard(p)]


def _turns(t) -> list[tuple[int, int]]:
    """(start, end) of each run of sampled tokens (loss mask 1) in a trajectory."""
    m = np.r_[0, t.loss_mask, 0]
    edges = np.flatnonzero(np.diff(m))
    return list(zip(edges[::2], edges[1::2]))


def test_the_example_reward_and_two_turn_workflow_run_from_their_files_at_eta0(tmp_path):
    cfg = load_config(
        EXAMPLE,
        [
            f"store.run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            "rollout.eta=0",
            "trainer.versions=5",
            "trainer.warm_start_steps=20",
            "logging.eval_every=0",
            "logging.eval_prompts=20",
            "logging.progress=false",
            "logging.tensorboard=false",
        ],
    )
    assert cfg.reward.fn == f"{ROOT}/jobs/examples/my_reward.py:reward"  # made absolute for every rank
    s = launch(cfg, progress=False)
    assert s["versions"] == 5 and s["acc_final"] is not None
    run = tmp_path / "run"
    eaten = _audit(run, eta=0)
    assert (eaten["version_start"] == eaten["version_end"]).all()  # at eta 0 no episode mixes two versions
    tok = load_tokenizer(tmp_path / "model")
    no = render_turn(tok, "user", "no", chat=True)
    two = 0
    for t in _trajectories(run):
        turns = _turns(t)
        assert 1 <= len(turns) <= 2 and turns[0][0] == t.prompt_len
        assert t.reward in (0.0, 0.05, 0.1, 0.5, 1.0)  # what my_reward and two_turn can give
        if len(turns) == 2:  # the feedback between the answers, token for token, never trained
            two += 1
            assert t.input_ids[turns[0][1] : turns[1][0]].tolist() == no
            assert (t.versions[turns[0][1] : turns[1][0]] == -1).all() and t.reward < 1.0
        assert (t.versions[t.loss_mask == 1] >= 0).all() and (t.versions[t.loss_mask == 0] == -1).all()
    assert two > 0
    m = pd.read_csv(run / "metrics.csv")
    assert m["reward_mean"].notna().sum() >= 5


def test_multi_turn_episodes_straddle_weight_loads_and_keep_the_staleness_bound(tmp_path):
    cfg = load_config(
        ROOT / "jobs" / "demo.yaml",
        [
            f"store.run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            "rollout.workflow=multi_turn",
            "workflow.max_turns=3",
            "rollout.eta=2",
            "rollout.weight_update=keep_kv",
            "rollout.max_new_tokens=24",
            "rollout.batch_prompts=8",
            "rollout.max_concurrent_groups=8",
            "ppo.drop_uniform_groups=false",
            "ppo.n_minibatches=1",
            "cluster.n_generators=1",
            "trainer.warm_start_steps=0",
            "trainer.versions=6",
            "trainer.max_wall_s=0",
            "logging.eval_every=0",
            "logging.eval_prompts=10",
            "logging.progress=false",
            "logging.tensorboard=false",
        ],
    )
    s = launch(cfg, progress=False)
    assert s["versions"] == 6
    eaten = _audit(tmp_path / "run", eta=2)  # nothing beyond eta (oldest sampled token), nothing twice
    assert len(eaten) == 6 * 8 * cfg.rollout.n_samples
    across = inside = 0
    for t in _trajectories(tmp_path / "run"):
        turns = _turns(t)
        per_turn = [set(t.versions[a:b].tolist()) for a, b in turns]
        across += len(turns) > 1 and len(set().union(*per_turn)) > 1 and per_turn[0] != per_turn[-1]
        inside += any(len(v) > 1 for v in per_turn)
    assert across > 0, "no episode's turns ran on different weights"
    assert inside > 0, "no turn ran on across a weight load"
