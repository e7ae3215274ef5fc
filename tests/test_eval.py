"""`areal-hpc eval` on a demo checkpoint: avg@k and pass@k agree with the samples; greedy equals the logged accuracy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from areal_hpc.cli import main
from areal_hpc.config import load_config
from areal_hpc.evaluation import pass_at_k
from areal_hpc.rundir import RunDir
from areal_hpc.runtime.sync_loop import run_sync

DEMO = Path(__file__).resolve().parents[1] / "jobs" / "demo_sync.yaml"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A few RL versions after the warm start: answers are right often enough for pass@k to differ from avg@k."""
    tmp = tmp_path_factory.mktemp("evalrun")
    cfg = load_config(
        DEMO,
        [
            f"store.run_dir={tmp / 'run'}",
            f"model.path={tmp / 'model'}",
            "trainer.versions=4",
            "logging.eval_every=0",
            "logging.progress=false",
            "logging.trackers=[]",
        ],
    )
    return run_sync(cfg)


def _eval(args):
    res = CliRunner().invoke(main, ["eval", *args])
    assert res.exit_code == 0, res.output
    return res.output


def test_greedy_eval_equals_the_accuracy_the_run_logged(demo_run, tmp_path):
    ckpt = RunDir(demo_run.run_dir).trainer_checkpoint(demo_run.versions)
    out = tmp_path / "greedy.json"
    text = _eval([str(ckpt), "--n-samples", "1", "--temperature", "0", "--engine", "torch", "--json", str(out)])
    got = json.loads(out.read_text())
    m = pd.read_csv(demo_run.run_dir / "metrics.csv").set_index("version")
    logged = m["heldout_acc"][demo_run.versions]
    assert got["version"] == demo_run.versions and got["n_problems"] == 100
    assert got["avg_at_k"] == pytest.approx(logged) == pytest.approx(demo_run.acc_after)
    # the sync loop logs the mean reward beside the accuracy; the math reward is 0 or 1, so they agree here
    assert got["reward_mean"] == pytest.approx(m["heldout_reward_mean"][demo_run.versions]) == pytest.approx(logged)
    assert demo_run.reward_after == pytest.approx(logged) and got["threshold"] == 1.0
    assert f"pass@1:    {logged:.1%}" in text

    # the same weights as a plain Hugging Face folder (what an export holds) give the same figure
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(demo_run.run_dir.parent / "model", hf)
    shutil.copy(ckpt / "model.safetensors", hf / "model.safetensors")
    cfg = RunDir(demo_run.run_dir).config
    _eval([str(hf), "--config", str(cfg), "--engine", "torch", "--json", str(out)])
    assert json.loads(out.read_text())["avg_at_k"] == pytest.approx(logged)


def test_sampled_eval_agrees_with_a_direct_count(demo_run, tmp_path):
    ckpt = RunDir(demo_run.run_dir).trainer_checkpoint(demo_run.versions)
    out = tmp_path / "k4.json"
    _eval([str(ckpt), "--n-samples", "4", "--temperature", "1.0", "--json", str(out)])  # vLLM when installed
    got = json.loads(out.read_text())
    rewards = got["rewards"]
    assert len(rewards) == 100 and all(len(r) == 4 for r in rewards)
    flat = [x for r in rewards for x in r]
    assert got["avg_at_k"] == pytest.approx(sum(flat) / len(flat))
    assert got["pass_at_k"]["1"] == pytest.approx(got["avg_at_k"])
    assert got["pass_at_k"]["4"] == pytest.approx(sum(any(r) for r in rewards) / 100)  # any of the 4 right
    c = [round(sum(r)) for r in rewards]
    assert got["pass_at_k"]["2"] == pytest.approx(sum(1 - math.comb(4 - x, 2) / math.comb(4, 2) for x in c) / 100)
    assert 0 < got["avg_at_k"] < got["pass_at_k"]["4"] < 1  # the demo policy is neither hopeless nor perfect
    per = [sum(r) / 4 for r in rewards]
    sd = (sum((p - got["avg_at_k"]) ** 2 for p in per) / 99) ** 0.5
    assert got["avg_at_k_stderr"] == pytest.approx(sd / 10)
    assert 0 < got["mean_response_tokens"] <= 8 and 0 <= got["truncated_share"] <= 1


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 2) == 0 and pass_at_k(4, 3, 2) == 1 and pass_at_k(4, 4, 1) == 1
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    with pytest.raises(ValueError, match="pass@8 needs at least 8 samples"):
        pass_at_k(4, 1, 8)


def test_eval_refuses_what_it_cannot_use_in_one_line(demo_run, tmp_path):
    res = CliRunner().invoke(main, ["eval", str(tmp_path)])
    assert res.exit_code != 0 and "has no config.json" in res.output and res.output.count("\n") == 1
    ckpt = RunDir(demo_run.run_dir).trainer_checkpoint(demo_run.versions)
    res = CliRunner().invoke(main, ["eval", str(ckpt), "--data", "x.csv", "--engine", "torch"])
    assert res.exit_code != 0 and "must be 'heldout'" in res.output and res.output.count("\n") == 1
    res = CliRunner().invoke(main, ["eval", str(ckpt), "--n-samples", "3", "--engine", "torch"])
    assert res.exit_code != 0 and "--temperature 0 (greedy)" in res.output


def test_eval_renders_a_checked_one_node_slurm_job(demo_run):
    ckpt = RunDir(demo_run.run_dir).trainer_checkpoint(demo_run.versions)
    script = _eval([str(ckpt), "--n-samples", "8", "--temperature", "1", "--slurm", "slurm.gpus_per_node=0"])
    assert script.startswith("#!/bin/bash") and "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n" in script
    assert f"#SBATCH --output={RunDir(demo_run.run_dir).eval_output}" in script
    run_line = [ln for ln in script.splitlines() if "areal_hpc.cli eval" in ln][-1]
    assert f"eval {ckpt} --data heldout --n-samples 8 --temperature 1.0" in run_line
    assert "--slurm" not in run_line and run_line.endswith("slurm.gpus_per_node=0")


def test_eval_prints_only_its_answer_unless_verbose(demo_run):
    """vLLM logs ~40 lines from Python, C++ and progress bars, to stdout and stderr: a real process, not
    CliRunner, shows what a user's terminal gets."""
    import subprocess
    import sys

    ckpt = RunDir(demo_run.run_dir).trainer_checkpoint(demo_run.versions)
    cmd = [sys.executable, "-m", "areal_hpc.cli", "eval", str(ckpt), "--engine", "vllm"]
    quiet = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    heads = [ln.split(":")[0] for ln in quiet.stdout.splitlines()]
    assert heads == ["model", "data", "pass@1", "reward", "answers", "time"] and quiet.stderr == "", quiet
    loud = subprocess.run([*cmd, "--verbose"], capture_output=True, text=True, timeout=600)
    assert loud.returncode == 0 and "Initializing a V1 LLM engine" in loud.stdout + loud.stderr
    assert quiet.stdout.splitlines()[2] in loud.stdout  # the same answer
