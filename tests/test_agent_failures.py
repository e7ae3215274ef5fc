"""End to end under mpirun (`areal-hpc run`): agents that fail train on within the failure budget, one that always
fails stops the run in one line naming its exception, and every failure is counted where the summary says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from test_agent_runs import short_agent_demo

from areal_hpc.cli.main import main
from areal_hpc.config import load_config
from areal_hpc.data import arithmetic_dataset

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "tests" / "data" / "flaky_agent.py"
EVAL_PROMPTS = 10


def _overrides(tmp: Path, run: str, agent: str) -> list[str]:
    # the model is built by the first run and reused by the second
    return [
        *short_agent_demo(f"{AGENT}:{agent}", tmp / run, tmp / "model", 3, EVAL_PROMPTS),
        "workflow.agent_timeout_s=2",
    ]


def _run(args: list[str], monkeypatch) -> tuple[int, str]:
    monkeypatch.chdir(ROOT)  # the demo's paths are relative to the repository root
    result = CliRunner().invoke(main, ["run", "jobs/demo_agent.yaml", *args, "--no-progress"])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("agent-failures")


def test_an_agent_failing_half_its_tries_trains_on_and_every_failure_is_counted(tmp, monkeypatch):
    """Half the training tries raise, and one held-out question hangs past the agent's time limit in every
    evaluation: the run ends as asked, the failures are counted by kind (training) and apart (held out), the
    summary's counts are the metrics.csv columns' sums plus what came after the last row, and the printed
    summary has an agents: line."""
    cfg = load_config(ROOT / "jobs" / "demo_agent.yaml", [])
    d = cfg.data
    held_out = arithmetic_dataset(d.train_size, d.heldout_size, d.max_operand, d.seed, d.operator, d.min_operand)
    questions = [p.row["question"] for p in held_out.heldout[:EVAL_PROMPTS]]
    monkeypatch.setenv("FLAKY_AGENT_HELD_OUT", ",".join(questions))  # the ranks inherit it (local mpirun)
    code, out = _run(_overrides(tmp, "half", "agent"), monkeypatch)
    assert code == 0, out
    s = json.loads((tmp / "half" / "summary.json").read_text())
    assert s["versions"] == 3 and s["failure"] is None
    # about half the training tries raised: each ran again, within the default budget
    by_kind = s["agent_failures_by_kind"]
    assert by_kind.get("raised", 0) > 0.3 * s["episodes_generated"], s
    assert s["agent_failures"] == sum(by_kind.values())
    # the hanging held-out question, once in each evaluation that ran (init, start, final), and nothing else
    evaluations = sum(s[f"acc_{t}"] is not None for t in ("init", "start", "final"))
    assert evaluations >= 2 and s["heldout_agent_failures"] == evaluations
    # each count is its metrics.csv column's sum plus the groups that came after the last row
    m = pd.read_csv(tmp / "half" / "metrics.csv")
    for key, extra in s["after_last_row"].items():
        assert m[key].fillna(0).sum() + extra == s[key], key
    line = next(ln for ln in out.splitlines() if ln.startswith("agents:"))
    assert re.search(rf"agents:\s+{s['agent_failures']} failed in training episodes \(raised \d+", line), line
    assert f"{evaluations} in held-out ones" in line and "branches" in line


def test_an_agent_that_always_fails_stops_the_run_in_one_line_naming_its_exception(tmp, monkeypatch):
    code, out = _run([*_overrides(tmp, "down", "always_down"), "logging.eval_prompts=1"], monkeypatch)
    assert code != 0
    errors = [ln for ln in out.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, out
    line = errors[0]
    raised_at = f"{AGENT.relative_to(ROOT)}:{_line_of(AGENT, 'ConnectionRefusedError(')}"
    assert f"the agent raised: ConnectionRefusedError: the tool's server is down at {raised_at}" in line, line
    assert "200 of the last 200 episodes failed" in line and "workflow.max_failure_share=0.75" in line
    # the shutdown that followed is not reported as a cause
    log = (tmp / "down" / "logs" / "rank001-generator.log").read_text()
    assert "endpoint's process" not in log and "InvalidStateError" not in log


def _line_of(path: Path, text: str) -> int:
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if text in ln)
