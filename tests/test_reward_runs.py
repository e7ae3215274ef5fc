"""End to end through `areal-hpc run`: a reward that fails for some rows and returns extras for others, a workflow
that logs a number; the failures are counted over every generated episode and shown, the numbers reach metrics.csv."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
from click.testing import CliRunner

from areal_hpc.cli import main
from areal_hpc.launch.local import reward_failures
from areal_hpc.rundir import RunDir
from areal_hpc.store import load_trajectories

ROOT = Path(__file__).resolve().parents[1]

USER = r"""
import math
import re


def reward(completion, row):
    if int(row["answer"]) % 3 == 0:
        return math.nan  # a bug for a third of the rows: every answer to them scores 0, so their groups are uniform
    found = re.findall(r"\\boxed\{([0-9]+)\}", completion)
    right = bool(found) and found[-1] == str(row["answer"])
    return {"score": 1.0 if right else 0.1 * bool(found), "boxed": float(bool(found))}


async def answer_once(ep):
    answer = await ep.generate()
    ep.log("answer_tokens", len(answer.ids))
    return await ep.reward(answer.text) if answer.finish_reason == "stop" else 0.0
"""


def test_nan_rewards_are_counted_over_every_episode_and_extras_and_logged_numbers_reach_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    user = tmp_path / "user.py"
    user.write_text(USER)
    run = tmp_path / "run"
    args = [
        "run",
        str(ROOT / "jobs" / "examples" / "custom.yaml"),
        f"store.run_dir={run}",
        f"model.path={tmp_path / 'model'}",
        f"reward.fn={user}:reward",
        f"workflow.fn={user}:answer_once",
        "trainer.versions=4",
        "trainer.warm_start_steps=20",
        "logging.eval_every=0",
        "logging.eval_prompts=12",
        "logging.trackers=[]",
        "--no-progress",
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    s = json.loads((run / "summary.json").read_text())
    m = pd.read_csv(run / "metrics.csv")
    assert s["versions"] == 4 and s["reward_errors"] > 0 and s["reward_timeouts"] == 0
    # every answer to a third of the rows failed: those groups were all 0, rejected as uniform, never trained on,
    # and still counted (metrics.csv counts the episodes generated between two rows)
    eaten = load_trajectories(run, verify_tokens=False)
    eaten = eaten[eaten["consumed_version"] >= 0]
    assert len(eaten) and (eaten["reward_errors"] == 0).all() and s["rejected_uniform"] > 0
    assert 0 < m["reward_errors"].sum() <= s["reward_errors"]
    assert (m["episodes_generated"].iloc[1:] > 0).all()
    # a held-out answer to such a row fails too, counted apart
    assert s["heldout_reward_errors"] > 0
    # the reward's extra and the workflow's number, averaged per version
    assert m["reward/boxed"].iloc[1:].between(0, 1).all() and m["reward/boxed"].iloc[1:].notna().all()
    assert (m["episode/answer_tokens"].iloc[1:] >= 1).all()
    assert 0 < s["turns_per_episode"] == 1.0 and s["tool_calls_per_episode"] == 0.0
    # progress.json has them for the progress bar, which shows them once there are any
    p = json.loads(RunDir(run).progress.read_text())
    assert p["reward_errors"] == s["reward_errors"] and p["heldout_reward_errors"] == s["heldout_reward_errors"]
    assert reward_failures(p) == {"reward errors": str(s["reward_errors"] + s["heldout_reward_errors"])}
    # the printed summary says so, and the generator's log names the first bad value once
    line = next(ln for ln in res.output.splitlines() if ln.startswith("reward fn:"))
    assert f"{s['reward_errors']} errors and 0 time-outs in training episodes" in line
    assert f"{s['heldout_reward_errors']} and 0 in held-out" in line
    assert re.search(r"episodes: +\d+ generated for training, 1.00 turns", res.output)
    log = RunDir(run).rank_log(1, "generator").read_text()
    assert log.count("reward function returned nan (float)") == 1
