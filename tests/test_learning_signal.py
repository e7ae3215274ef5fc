"""A run that cannot learn says so: groups whose samples all score alike are counted by value, a streak of them
is a warning on the terminal, and a longer one with no version trained stops the run with one line and a
non-zero exit (trainer.max_uniform_batches)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from areal_hpc.runtime.reporting.learning_signal import UniformGroups

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"
CLI = [sys.executable, "-m", "areal_hpc.cli"]


def test_a_streak_of_uniform_groups_warns_then_stops_and_a_spread_or_a_trained_version_resets_it():
    w = UniformGroups.for_run(batch_prompts=2, max_uniform_batches=4)
    assert (w.warn_after, w.stop_after) == (6, 8)  # 3 batches' worth to warn, the setting's to stop
    assert [w.group(0.0) for _ in range(5)] == [None] * 5
    assert w.group(1.0) == "warn"  # all-right groups teach nothing either
    assert w.group(0.0) is None  # warned once per streak
    assert w.group(None) == "clear" and w.group(None) is None  # a group with a spread ends the streak
    for _ in range(7):
        w.group(0.0)
    w.version_trained()  # ppo.drop_uniform_groups=false: versions still train, so the run is not stuck
    assert [w.group(0.0) for _ in range(7)] == [None] * 7
    assert w.group(0.0) == "stop" and w.group(0.0) is None  # 8 with no version trained; said once
    line = w.stop_line(4)
    assert "\n" not in line and "trainer.max_uniform_batches=4" in line and "{0.0: 16}" in line, line
    assert "the reward" in line and "the warm start" in line and "prompt format" in line
    assert w.summary() == {"0.0": 22, "1.0": 1}
    again = UniformGroups.for_run(batch_prompts=2, max_uniform_batches=0)  # 0: never stops, still warns
    assert [again.group(0.5) for _ in range(100)].count("warn") == 1 and "stop" not in {again.group(0.5)}
    again.load(w.summary())  # a resumed run keeps its counts
    assert again.by_value == {0.0: 22, 1.0: 1}


def test_a_reward_that_is_always_zero_stops_the_run_with_one_line_and_a_non_zero_exit(tmp_path):
    # a config built on the demo with the user's own rows (no reference answers) and a reward that never credits
    # anything: the warm start is off, so the run starts, and every group scores 0.0
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i:02d}+{i:02d}="}) + "\n" for i in range(40)))
    reward = tmp_path / "never.py"
    reward.write_text("def never(completion, row):\n    return 0.0\n")
    run = tmp_path / "run"
    args = [
        f"store.run_dir={run}",
        f"model.path={tmp_path / 'model'}",
        "data.kind=jsonl",
        f"data.path={data}",
        "data.heldout_size=4",
        f"reward.fn={reward}:never",
        "trainer.warm_start_steps=0",
        "trainer.max_wall_s=0",
        "rollout.batch_prompts=4",
        "rollout.n_samples=4",
        "rollout.max_concurrent_groups=4",
        "cluster.n_generators=1",
        "logging.eval_prompts=4",
        "logging.trackers=[]",
    ]
    r = subprocess.run([*CLI, "run", str(DEMO), *args, "--no-progress"], capture_output=True, text=True, timeout=600)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error")]
    assert r.returncode != 0 and len(errors) == 1, r.stdout + r.stderr
    assert "the run cannot learn" in errors[0] and "{0.0: " in errors[0], errors[0]
    assert "trainer.max_uniform_batches=20" in errors[0] and "likely causes" in errors[0], errors[0]
    # the terminal said so as soon as 3 batches' worth had scored alike, long before the stop
    assert any(ln.startswith("warning: no learning signal") and "{0.0: 12}" in ln for ln in r.stderr.splitlines())
    progress = json.loads((run / "progress.json").read_text())
    assert progress["warning"].startswith("no learning signal"), progress
    s = json.loads((run / "summary.json").read_text())
    assert s["versions"] == 0 and s["failure"] and "cannot learn" in s["failure"]
    assert list(s["uniform_groups"]) == ["0.0"] and s["uniform_groups"]["0.0"] >= 80, s["uniform_groups"]
    assert s["rejected_uniform"] == s["uniform_groups"]["0.0"]
    assert (run / "checkpoints").exists()  # it stopped as a stop does: a checkpoint of where it was
