"""The warm start's targets come from trainer.warm_start_template over each row, and rows that lack what it names
stop the run at start-up in one line, before the run directory is written."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, load_config
from areal_hpc.data import read_dataset
from areal_hpc.workflow.warm_start import WarmStartError, check_warm_start, warm_start_segments, warm_start_targets

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"
CLI = [sys.executable, "-m", "areal_hpc.cli"]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path: Path, rows: list[dict], *overrides: str):
    data = _jsonl(tmp_path / "rows.jsonl", rows)
    base = ["model.path=/unused", "data.kind=jsonl", f"data.path={data}", "data.heldout_size=1"]
    return load_config(DEMO, [*base, *overrides])


def test_math_rows_train_on_the_boxed_final_answer_the_built_in_reward_credits(tmp_path):
    rows = [{"question": f"{i}+{i}=?", "answer": f"{i} plus {i} #### {2 * i}"} for i in range(6)]  # GSM8K style
    cfg = _cfg(tmp_path, rows)
    ds = read_dataset(cfg.data)
    targets = warm_start_targets(ds.train, cfg)
    assert targets == [f"\\boxed{{{2 * int(p.row['question'].split('+')[0])}}}" for p in ds.train]
    # a template of the user's own: any row field, {answer} the reference, {{ }} literal braces
    cfg = _cfg(tmp_path, rows, 'trainer.warm_start_template="{question} is {{{answer}}}"')
    assert warm_start_targets(ds.train[:1], cfg) == [f"{ds.train[0].row['question']} is {{{ds.train[0].answer}}}"]


class _Chars:
    """A tokenizer of one id per character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_the_arithmetic_demo_and_the_tool_demo_keep_their_warm_start():
    cfg = load_config(DEMO, ["model.path=/unused"])
    ds = read_dataset(cfg.data)
    assert warm_start_targets(ds.train[:3], cfg) == ["\\boxed{" + p.answer + "}" for p in ds.train[:3]]
    tool = load_config(ROOT / "jobs" / "demo_tool.yaml", ["model.path=/unused"])
    p = read_dataset(tool.data).train[0]
    rng = random.Random(0)
    segments = [warm_start_segments(p, "\\boxed{" + p.answer + "}", tool, rng, _Chars()) for _ in range(50)]
    shapes = {tuple(s.trained for s in segs) for segs in segments}
    assert shapes == {(True,), (True, False, True)}  # a direct answer, or a tool call whose output is not trained


def test_rows_without_the_field_stop_in_one_line_naming_it_and_the_way_out(tmp_path):
    rows = [{"question": f"{i}+1=", "label": str(i + 1)} for i in range(6)]
    cfg = _cfg(tmp_path, rows, "reward.fn=jobs/examples/my_reward.py:reward")  # a user's reward: rows load
    with pytest.raises(WarmStartError) as err:
        check_warm_start(cfg)
    line = str(err.value)
    assert "\n" not in line and "'answer' (data.answer_key)" in line and "rows.jsonl" in line, line
    assert "trainer.warm_start_steps=0" in line and "trainer.warm_start_template" in line, line
    check_warm_start(_cfg(tmp_path, rows, "reward.fn=jobs/examples/my_reward.py:reward", "data.answer_key=label"))
    check_warm_start(_cfg(tmp_path, rows, "reward.fn=jobs/examples/my_reward.py:reward", "trainer.warm_start_steps=0"))
    named = _cfg(tmp_path, rows, "reward.fn=jobs/examples/my_reward.py:reward", 'trainer.warm_start_template="{why}"')
    with pytest.raises(WarmStartError, match="have no 'why'"):
        check_warm_start(named)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["trainer.warm_start_template=boxed"], "must name a row field"),
        (["data.kind=code", "data.path=x.jsonl", "trainer.warm_start_steps=5"], "warm_start_steps must be 0"),
        (
            [
                "data.kind=code",
                "data.path=x.jsonl",
                "trainer.warm_start_steps=5",
                'trainer.warm_start_template="{answer}"',
            ],
            "the row's tests",
        ),
    ],
)
def test_warm_start_templates_that_cannot_work_are_one_line(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [*overrides, "model.path=/nonexistent"])
    assert "\n" not in str(err.value) and named in str(err.value), err.value
    # a code task warm-starts on a solution field the user names
    load_config(
        DEMO, ["data.kind=code", "data.path=x", "trainer.warm_start_steps=5", 'trainer.warm_start_template="{sol}"']
    )


def test_a_demo_config_on_rows_lacking_the_answer_stops_at_start_up_through_the_cli(tmp_path):
    # the finding: a config built on the demo, with the user's own jsonl and reward, trained 0 versions on a warm
    # start that taught empty answers; now `run` refuses before the run directory exists or a model is built
    data = _jsonl(tmp_path / "mine.jsonl", [{"question": f"{i}+{i}=", "expected": str(2 * i)} for i in range(20)])
    reward = tmp_path / "score.py"
    reward.write_text("def score(completion, row):\n    return float(row['expected'] in completion)\n")
    run_dir, model = tmp_path / "run", tmp_path / "model"
    args = [f"store.run_dir={run_dir}", f"model.path={model}", "data.kind=jsonl", f"data.path={data}"]
    r = subprocess.run(
        [*CLI, "run", str(DEMO), *args, f"reward.fn={reward}:score", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("Error")]
    assert r.returncode != 0 and len(lines) == 1, r.stdout + r.stderr
    assert "'answer' (data.answer_key)" in lines[0] and "trainer.warm_start_steps=0" in lines[0], lines[0]
    assert not run_dir.exists() and not model.exists()
