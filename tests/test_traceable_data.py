"""Traceable data: each stored trajectory's dataset row and the run's data fingerprint; held-out accuracy beside
the mean reward (partial credit counts only in the latter), end to end and on the parts."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from areal_hpc.cli import main
from areal_hpc.config import ConfigError, load_config
from areal_hpc.config.task import DataConfig
from areal_hpc.data import load_math_dataset
from areal_hpc.data.record import dataset_rows, fingerprint, record_dataset
from areal_hpc.evaluation import heldout_figures, summarize
from areal_hpc.model import load_tokenizer
from areal_hpc.rundir import RunDir
from areal_hpc.store import list_shards, load_trajectories, read_shard

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"

# Partial credit that does not depend on being right: every episode scores 0.5 or 1.0 (an answer cut off at the
# length limit too), by its text and its row's question, so a held-out evaluation's mean reward is exactly
# 0.5 + accuracy / 2 and held-out rows score both ways.
PARTIAL = """
def reward(completion, row):
    return 1.0 if (sum(map(ord, completion)) + int(row["uid"].split("-")[0][1:])) % 2 else 0.5


async def every_answer_scored(ep):
    answer = await ep.generate()
    return await ep.reward(answer.text)
"""


def _write_rows(path: Path, n_questions: int = 12, copies: int = 3) -> list[dict]:
    """Each question `copies` times (a uid tells the rows apart), after a malformed line and with a blank one:
    row indices are file positions, not the count of usable rows."""
    rows = [{"question": f"{a}+{a + 3}=", "answer": str(2 * a + 3)} for a in range(n_questions)]
    lines = ['{"question": ""}']  # skipped: empty question
    for c in range(copies):
        for i, r in enumerate(rows):
            lines.append(json.dumps(r | {"uid": f"q{i}-copy{c}"}))
        if c == 0:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return [json.loads(x) if x.strip() else None for x in lines]


def test_a_run_keeps_each_trajectorys_row_and_reports_accuracy_beside_mean_reward(tmp_path):
    data, user = tmp_path / "rows.jsonl", tmp_path / "partial.py"
    lines = _write_rows(data)
    user.write_text(PARTIAL)
    overrides = [
        f"store.run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        "data.kind=jsonl",
        f"data.path={data}",
        "data.heldout_size=6",
        f"reward.fn={user}:reward",
        f"workflow.fn={user}:every_answer_scored",
        "rollout.batch_prompts=8",
        "rollout.n_samples=4",
        "rollout.max_concurrent_groups=8",
        "cluster.n_generators=1",
        "trainer.warm_start_steps=0",
        "trainer.versions=3",
        "trainer.max_wall_s=0",
        "logging.eval_every=1",
        "logging.eval_prompts=6",
    ]
    res = CliRunner().invoke(main, ["run", str(DEMO), *overrides, "--no-progress"])
    assert res.exit_code == 0, res.output
    run = RunDir(tmp_path / "run")

    # the run's data by fingerprint, written once at its start
    rec = json.loads(run.dataset.read_text())
    assert rec["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest() and rec["path"] == str(data.resolve())
    assert rec["kind"] == "jsonl" and rec["bytes"] == data.stat().st_size

    # every stored trajectory names its row: its line in the file (the malformed first line and the blank one
    # shift prompt_id, which counts usable rows only)
    ds = load_math_dataset(data, "jsonl", heldout_size=6)
    row_of = {p.prompt_id: p.row_index for p in ds.train}
    trajs = [t for p in list_shards(run.rollouts) for t in read_shard(p)]
    assert trajs and all(t.row_index == row_of[t.prompt_id] for t in trajs)
    assert any(t.row_index != t.prompt_id for t in trajs)
    tok = load_tokenizer(tmp_path / "model")
    df = load_trajectories(run.root, rows=True)
    assert list(df["row_index"]) == [t.row_index for t in trajs]
    for t, uid, q in zip(trajs, df["row.uid"], df["row.question"], strict=True):
        assert lines[t.row_index]["uid"] == uid and lines[t.row_index]["question"] == q
        assert q in tok.decode(t.input_ids[: t.prompt_len])
    # rows with the same prompt told apart: one question trained from two of its rows, each joined to its own
    per_question = df.groupby("row.question")["row.uid"].nunique()
    assert per_question.max() >= 2, per_question
    # the same join from a copy of the file moved elsewhere; a different file is refused in one line
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(data.read_bytes())
    assert list(load_trajectories(run.root, rows=moved)["row.uid"]) == list(df["row.uid"])
    moved.write_text(data.read_text().replace("q0-copy0", "q0-copyX"))
    with pytest.raises(ValueError, match="is not the data the run read") as err:
        load_trajectories(run.root, rows=moved)
    assert "\n" not in str(err.value)

    # held-out accuracy (reward >= logging.eval_threshold = 1.0) and mean reward, named apart everywhere
    s = json.loads(run.summary.read_text())
    assert s["eval_threshold"] == 1.0
    for tag in ("init", "final"):
        acc, mean = s[f"acc_{tag}"], s[f"heldout_reward_mean_{tag}"]
        assert acc in {k / 6 for k in range(7)} and mean == pytest.approx(0.5 + acc / 2), (tag, acc, mean)
    m = pd.read_csv(run.metrics).dropna(subset=["heldout_acc"])
    assert len(m) >= 3
    np.testing.assert_allclose(m["heldout_reward_mean"], 0.5 + m["heldout_acc"] / 2)
    assert (m["heldout_reward_mean"] > m["heldout_acc"]).all()  # partial credit never passes for accuracy
    assert 0 < s["acc_init"] < 1
    assert f"accuracy (reward >= 1) {s['acc_init']:.1%} at start" in res.output
    assert f"mean reward {s['heldout_reward_mean_init']:.3f} at start" in res.output

    # `areal-hpc eval` on the final checkpoint: the same two figures, told apart
    ckpt = run.trainer_checkpoint(s["versions"])
    out = tmp_path / "eval.json"
    res = CliRunner().invoke(main, ["eval", str(ckpt), "--engine", "torch", "--json", str(out)])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    assert got["threshold"] == 1.0 and got["n_problems"] == 6
    assert got["reward_mean"] == pytest.approx(0.5 + got["avg_at_k"] / 2)
    assert got["avg_at_k"] == pytest.approx(sum(r[0] >= 1.0 for r in got["rewards"]) / 6)
    assert f"pass@1:    {got['avg_at_k']:.1%}" in res.output
    assert f"reward:    {got['reward_mean']:.3f} mean; an answer counts as correct at reward >= 1" in res.output

    # the analysis report's tables carry both, named apart
    from areal_hpc.analysis import learning_curves, speedup_table
    from areal_hpc.analysis.report import write_report

    curves = learning_curves([run.root]).dropna(subset=["heldout_acc"])
    np.testing.assert_allclose(curves["heldout_reward_mean"], 0.5 + curves["heldout_acc"] / 2)
    table = speedup_table([run.root])
    assert table["heldout_reward_mean_final"].iloc[0] == s["heldout_reward_mean_final"]
    assert table["acc_final"].iloc[0] == s["acc_final"]
    page = write_report([run.root], tmp_path / "report.html").read_text()
    assert "<th>acc_final</th>" in page and "<th>heldout_reward_mean_final</th>" in page


def test_rows_of_a_parquet_file_keep_their_positions_and_a_record_is_written_once(tmp_path):
    rows = [{"question": "1+1=", "answer": "2", "uid": i} for i in range(4)] + [{"question": None, "answer": "x"}]
    rows += [{"question": "2+2=", "answer": "4", "uid": 9}]
    f = tmp_path / "d.parquet"
    pd.DataFrame(rows).to_parquet(f)
    with pytest.warns(UserWarning, match="skipped 1"):
        ds = load_math_dataset(f, "parquet", heldout_size=0)
    assert [p.row_index for p in ds.train] == [0, 1, 2, 3, 5] and [p.prompt_id for p in ds.train] == [0, 1, 2, 3, 4]
    data_cfg = DataConfig(kind="parquet", path=str(f))
    run = tmp_path / "run"
    run.mkdir()
    assert record_dataset(run, data_cfg) is None and record_dataset(run, data_cfg) is None
    first = RunDir(run).dataset.read_text()
    got = dataset_rows(run)
    assert got.index.name == "row_index" and list(got.index) == list(range(6))
    assert list(got["uid"].iloc[[0, 3, 5]]) == [0, 3, 9]
    # the file changes under a resumed run: one line, and the record keeps what the run started on
    pd.DataFrame(rows[:3]).to_parquet(f)
    changed = record_dataset(run, data_cfg)
    assert "changed since the run started" in changed and "\n" not in changed
    assert RunDir(run).dataset.read_text() == first
    with pytest.raises(ValueError, match="is not the data the run read"):
        dataset_rows(run)


def test_the_arithmetic_tasks_fingerprint_follows_its_problems_and_its_rows_join_back(tmp_path):
    data_cfg = DataConfig(train_size=20, heldout_size=5, max_operand=9)
    a = fingerprint(data_cfg)
    assert a == fingerprint(data_cfg) and a["rows"] == 25 and a["params"]["seed"] == 0
    data_cfg.seed = 1
    assert fingerprint(data_cfg)["sha256"] != a["sha256"]
    record_dataset(tmp_path, data_cfg)
    rows = dataset_rows(tmp_path)
    from areal_hpc.data import arithmetic_dataset

    ds = arithmetic_dataset(20, 5, 9, 1)
    for p in ds.train + ds.heldout:  # train ids first, then held-out ids: each problem's index is its row
        assert p.row_index == p.prompt_id and rows.loc[p.row_index, "question"] == p.prompt
    with pytest.raises(ValueError, match="has no dataset.json"):
        dataset_rows(tmp_path / "elsewhere")


def test_accuracy_counts_rewards_at_the_threshold_and_the_mean_counts_partial_credit():
    assert heldout_figures([1.0, 0.5, 0.5, 0.0], 1.0) == {"heldout_acc": 0.25, "heldout_reward_mean": 0.5}
    assert heldout_figures([1.0, 0.5, 0.5, 0.0], 0.5)["heldout_acc"] == 0.75
    assert all(math.isnan(v) for v in heldout_figures([], 1.0).values())
    res = summarize([[1.0, 0.5], [0.5, 0.0]], [3, 4, 5, 6], [False] * 4, threshold=1.0)
    assert res.avg_at_k == 0.25 and res.reward_mean == 0.5 and res.pass_at_k[2] == 0.5
    with pytest.raises(ConfigError, match=r"logging.eval_threshold=nan must be a finite number"):
        load_config(DEMO, ["logging.eval_threshold=nan"])
