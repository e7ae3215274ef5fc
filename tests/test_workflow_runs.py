"""End to end under mpirun: user code from files outside the package, and multi-turn episodes across weight loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from test_runtime import _audit

from areal_hpc.cli import main
from areal_hpc.config import load_config
from areal_hpc.launch.local import launch
from areal_hpc.model import load_tokenizer
from areal_hpc.rundir import RunDir
from areal_hpc.runtime.comm.timeline import load_timeline
from areal_hpc.store import list_shards, load_trajectories, read_shard
from areal_hpc.workflow.builtin import tool_observation
from areal_hpc.workflow.tools import calculator

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "jobs" / "examples" / "custom.yaml"


def _trajectories(run: Path) -> list:
    return [t for p in list_shards(run / "rollouts") for t in read_shard(p)]


def _turns(t) -> list[tuple[int, int]]:
    """(start, end) of each run of sampled tokens (loss mask 1) in a trajectory."""
    m = np.r_[0, t.loss_mask, 0]
    edges = np.flatnonzero(np.diff(m))
    return list(zip(edges[::2], edges[1::2]))


def test_the_example_reward_and_two_turn_workflow_run_from_their_files_at_eta0(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's paths are relative to where a run starts: the repository root
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
            "logging.trackers=[]",
        ],
    )
    assert cfg.reward.fn == f"{ROOT}/jobs/examples/my_reward.py:reward"  # made absolute for every rank
    s = launch(cfg, progress=False)
    assert s["versions"] == 5 and s["acc_final"] is not None
    run = tmp_path / "run"
    eaten = _audit(run, eta=0)
    assert (eaten["version_start"] == eaten["version_end"]).all()  # at eta 0 no episode mixes two versions
    tok = load_tokenizer(tmp_path / "model")
    user = tok.convert_tokens_to_ids("<user>")
    two = 0
    for t in _trajectories(run):
        turns = _turns(t)
        assert 1 <= len(turns) <= 2 and turns[0][0] == t.prompt_len
        assert min(abs(t.reward - x) for x in (0.0, 0.05, 0.1, 0.5, 1.0)) < 1e-6  # what the example can give
        if len(turns) == 2:  # the feedback between the answers, token for token, never trained
            two += 1
            prompt = t.input_ids[: t.prompt_len].tolist()
            asked_again = prompt[prompt.index(user) :]  # the question as a user turn, in the tiny vocabulary
            assert t.input_ids[turns[0][1] : turns[1][0]].tolist() == asked_again
            assert tok.unk_token_id not in asked_again
            assert (t.versions[turns[0][1] : turns[1][0]] == -1).all() and t.reward < 1.0
        assert (t.versions[t.loss_mask == 1] >= 0).all() and (t.versions[t.loss_mask == 0] == -1).all()
    assert two > 0
    m = pd.read_csv(run / "metrics.csv")
    assert m["reward_mean"].notna().sum() >= 5


HANGING = r"""
import random
import time

from areal_hpc.workflow import multi_turn

_hung = []


def reward(completion, row):
    if not _hung:  # the first call in each worker process hangs: it is stopped at reward.timeout_s
        _hung.append(1)
        time.sleep(3600)
    return float(completion.endswith(str(row["answer"]) + "}"))


async def looping_tool_then_multi_turn(ep):
    if random.random() < 0.1:  # a tool that loops forever, stopped at workflow.tool_timeout_s
        await ep.run_python("while True:\n    pass")
    reward = await multi_turn(ep)
    return None if random.random() < 0.05 else reward  # rejected now and then: the sample runs again
"""


def test_multi_turn_episodes_straddle_weight_loads_past_hung_rewards_and_tools(tmp_path):
    user = tmp_path / "hanging.py"
    user.write_text(HANGING)
    cfg = load_config(
        ROOT / "jobs" / "demo.yaml",
        [
            f"store.run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            f"workflow.fn={user}:looping_tool_then_multi_turn",
            f"reward.fn={user}:reward",
            "reward.timeout_s=0.5",
            "workflow.tool_sandbox=auto",
            "workflow.tool_timeout_s=0.5",
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
            "logging.trackers=[]",
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
    # the hung reward call and the looping tools were stopped and counted; the run went on
    m = pd.read_csv(tmp_path / "run" / "metrics.csv")
    # the first call in each reward worker hangs: a training episode's (metrics.csv) or a held-out one's (summary)
    assert m["reward_timeouts"].sum() + s["heldout_reward_timeouts"] >= 1
    assert m["reward_errors"].sum() == 0 and s["heldout_reward_errors"] == 0
    assert m["tool_calls"].sum() > 0 and m["tool_errors"].sum() == m["tool_calls"].sum()
    assert (m["turns_mean"].dropna() > 1).all() and (m["trained_share"].dropna() < 1).all()
    assert (m["unsampled_tokens"].dropna() > 0).all()
    # what the versions counted is the consumed episodes' rows of the shards' episode tables, each once
    used = load_trajectories(tmp_path / "run").query("consumed_version >= 0")
    assert (m["tool_calls"].sum(), m["tool_errors"].sum()) == (used["tool_calls"].sum(), used["tool_errors"].sum())
    assert (m["turns_mean"] * m["samples"]).sum() == pytest.approx(used["turns"].sum())
    # the engine kept stepping while tools looped
    tl = load_timeline(tmp_path / "run")
    tools, gen = tl[tl.event == "tool"], tl[tl.event == "generate"]
    assert len(tools) >= m["tool_calls"].sum()  # the timeline also has groups generated but never consumed
    busy = [((gen.t_start < t.t_end) & (gen.t_end > t.t_start)).any() for t in tools.itertuples()]
    assert sum(busy) >= 0.5 * len(tools)


@pytest.mark.slow
def test_the_tool_demo_learns_to_call_its_calculator(tmp_path):
    cfg = load_config(
        ROOT / "jobs" / "demo_tool.yaml",
        [
            f"store.run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            "trainer.versions=30",  # held-out accuracy is past 90% by version 20
            "trainer.max_wall_s=0",  # versions, not seconds: a busy machine must not cut the run short
            "logging.eval_every=0",
            "logging.progress=false",
            "logging.trackers=[]",
        ],
    )
    s = launch(cfg, progress=False)
    # RL itself adds >= 20 points over the warm-started policy, and answers use the tool more
    assert s["acc_final"] - s["acc_start"] >= 0.20, (s["acc_start"], s["acc_final"])
    assert s["tool_share_final"] > s["tool_share_start"], (s["tool_share_start"], s["tool_share_final"])
    m = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert m["tool_calls"].sum() > 0 and m["tool_errors"].sum() < 0.2 * m["tool_calls"].sum()
    # token fidelity: what the trainer consumed is the sampled tokens, and between them exactly the rendered
    # observation of the calculator on the code block just sampled
    tok = load_tokenizer(tmp_path / "model")
    checked = 0
    for t in _trajectories(tmp_path / "run"):
        turns = _turns(t)
        for (a, b), (c, _) in zip(turns, turns[1:]):
            code = re.search(
                r"```python\n(.*?)```\n$", tok.decode(t.input_ids[a:b], skip_special_tokens=True), re.S
            ).group(1)
            want = tok.encode(tool_observation(calculator(code).text), add_special_tokens=False)
            assert t.input_ids[b:c].tolist() == want and (t.versions[b:c] == -1).all()
            checked += 1
        assert (t.loss_mask[: t.prompt_len] == 0).all() and t.loss_mask[turns[-1][1] :].sum() == 0
    assert checked > 1000
    # `areal-hpc eval` runs the run's workflow: the trained policy is evaluated with its tool
    ckpt = RunDir(tmp_path / "run").trainer_checkpoint(s["versions"])
    res = CliRunner().invoke(main, ["eval", str(ckpt), "--engine", "torch", "--json", str(tmp_path / "e.json")])
    assert res.exit_code == 0, res.output
    got = json.loads((tmp_path / "e.json").read_text())
    assert got["workflow"] == "tool" and got["tool_share"] == pytest.approx(s["tool_share_final"], abs=0.05)
    assert got["avg_at_k"] == pytest.approx(s["acc_final"], abs=0.05)
