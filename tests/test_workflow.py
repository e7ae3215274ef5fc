"""Workflows and user code by import path: episodes over the real torch engine, token fidelity, tools, refusals."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_hpc.config import WorkflowConfig, load_config
from areal_hpc.engines.torch_gen import TorchGenerationEngine
from areal_hpc.model import load_tokenizer
from areal_hpc.plugins import PluginError
from areal_hpc.reward import RewardPool, reward_pool_for
from areal_hpc.reward.functions import MathAnswer
from areal_hpc.types import GenRequest, SampleId
from areal_hpc.workflow import Episode, RunnerSettings, TooManyFailures, load_workflow, multi_turn
from areal_hpc.workflow.batch import EpisodeStart, run_episodes
from areal_hpc.workflow.runner import render_turn
from areal_hpc.workflow.samples import episode_counts, to_trajectories

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"
CLI = [sys.executable, "-m", "areal_hpc.cli"]


class RecordingEngine(TorchGenerationEngine):
    """The torch engine, keeping every output it returned and when each step ran."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.outputs = {}
        self.steps: list[float] = []

    def step(self):
        outs = super().step()
        self.steps.append(time.time())
        self.outputs.update((o.request_id, o) for o in outs)
        return outs


def _settings(tok, chat=True, **workflow) -> RunnerSettings:
    return RunnerSettings(WorkflowConfig(**workflow), max_new_tokens=6, max_context=512, chat=chat, sandbox="auto")


def _starts(tok, n: int, greedy=False) -> list[EpisodeStart]:
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+7="}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    return [EpisodeStart(str(SampleId(0, i)), {"question": "12+7=", "answer": "19"}, ids, greedy) for i in range(n)]


def test_multi_turn_episodes_train_on_exactly_the_sampled_tokens(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    eng = RecordingEngine(str(tiny_model_dir), seed=3, max_num_seqs=8)
    settings = _settings(tok, max_turns=3, feedback="try again")
    feedback = render_turn(tok, "user", "try again", chat=True)
    assert tok.decode(feedback).startswith("<user>") and tok.decode(feedback).endswith("<assistant>")
    with RewardPool(num_workers=1, scorer=MathAnswer()) as pool:
        eps = run_episodes(eng, multi_turn, tok, pool, settings, _starts(tok, 12))
    turns = [e.stats.turns for e in eps]
    assert max(turns) >= 2, turns  # an untrained model is wrong: feedback turns happen
    for k, ep in enumerate(eps):
        (t,) = to_trajectories(ep, SampleId(0, k), 0, 0)
        sampled = sorted((o for r, o in eng.outputs.items() if r.episode == ep.key), key=lambda o: o.request_id.call)
        assert len(sampled) == ep.stats.turns
        # the transcript is the prompt, then each answer as sampled with the rendered feedback between
        want, mask = list(sampled[0].prompt_ids), [0] * len(sampled[0].prompt_ids)
        for i, o in enumerate(sampled):
            assert o.prompt_ids == want  # each turn continued exactly the tokens so far
            more = feedback if i + 1 < len(sampled) else []
            want += o.output_ids + more
            mask += [1] * len(o.output_ids) + [0] * len(more)
        assert t.input_ids.tolist() == want and t.loss_mask.tolist() == mask
        on = t.loss_mask == 1
        assert t.behav_logprobs[on].tolist() == pytest.approx([lp for o in sampled for lp in o.output_logprobs])
        assert (t.versions[~on] == -1).all() and (t.versions[on] == 0).all()
        assert t.reward in (0.0, 1.0, 0.5, 0.25)
    eng.close()


_SEEN: set[str] = set()


async def _rejects_first(ep: Episode) -> float | None:
    answer = await ep.generate()
    if ep.key not in _SEEN:
        _SEEN.add(ep.key)
        return None  # the first episode of each sample is rejected: it runs again
    return float(len(answer.ids))


async def _naps(ep: Episode) -> float:
    await asyncio.sleep(0.05)  # waits for nothing of the runner's: only its idle poll wakes this episode
    answer = await ep.generate()
    await asyncio.sleep(0.05)
    return float(len(answer.ids))


async def _raises(ep: Episode) -> float:
    await ep.generate()
    raise KeyError("no_such_field")


_TRIES: dict = {}


async def _raises_every_other_try(ep: Episode) -> float:
    """A flaky tool: the first try of each episode raises, the second scores."""
    answer = await ep.generate()
    _TRIES[ep.key] = _TRIES.get(ep.key, 0) + 1
    if _TRIES[ep.key] % 2:
        raise ConnectionError("the tool's server went away")
    return float(len(answer.ids))


def test_a_rejected_episode_runs_again_and_a_raising_workflow_stops_in_one_line(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    eng = RecordingEngine(str(tiny_model_dir), seed=4, max_num_seqs=4)
    with RewardPool(num_workers=1, scorer=MathAnswer()) as pool:
        eps = run_episodes(eng, _rejects_first, tok, pool, _settings(tok), _starts(tok, 6))
        assert all(e.reward is not None and e.reward >= 1 for e in eps)
        assert len(eng.outputs) == 12  # every sample generated twice, its slots refilled
        napped = run_episodes(eng, _naps, tok, pool, _settings(tok), _starts(tok, 3))
        assert all(e.reward >= 1 and e.t_end - e.t_start >= 0.1 for e in napped)
        # half the tries fail: each runs again, counted on the episode that ran, within the budget
        flaky = run_episodes(eng, _raises_every_other_try, tok, pool, _settings(tok), _starts(tok, 4))
        assert all(e.reward is not None and e.failure is None for e in flaky)
        assert [e.stats.agent_failures for e in flaky] == [1] * 4
        assert [e.stats.failure_kinds for e in flaky] == [{"raised": 1}] * 4
        # every try fails: once the window is full the run stops, naming the exception and the user's line
        settings = _settings(tok, failure_window=6)
        with pytest.raises(TooManyFailures, match="KeyError: 'no_such_field'") as err:
            run_episodes(eng, _raises, tok, pool, settings, _starts(tok, 3))
        line = str(err.value)
        assert "\n" not in line and "workflow.max_failure_share=0.75" in line and "workflow.failure_window=6" in line
        where = f"test_workflow.py:{_raises.__code__.co_firstlineno + 2}"  # its raise
        assert f"the workflow raised: KeyError: 'no_such_field' at tests/{where}" in line or where in line, line
        assert "6 of the last 6 episodes failed" in line
    assert eng.num_running == 0 and eng.num_waiting == 0  # nothing left holding a slot
    eng.close()


HOSTILE_TOOL_CALLS = {
    "infinite loop": "while True:\n    pass",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "large allocation": "x = bytearray(10 * 1024**3)",
    "loopback connect": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
    "write outside": "open('/tmp/areal-tool-escape', 'w').write('x')",
    "read the run directory": "print(open('{run}/secret.txt').read())",
    "kill the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "huge output": "print('x' * 10**8)",
}


def test_tool_calls_wait_off_the_engine_and_hostile_code_ends_safely(tiny_model_dir, tmp_path):
    (tmp_path / "secret.txt").write_text("the run's secret")
    tok = load_tokenizer(tiny_model_dir)
    eng = RecordingEngine(str(tiny_model_dir), seed=5, max_num_seqs=8)
    calls = list(HOSTILE_TOOL_CALLS.values())
    results = {}

    async def hostile_tool(ep: Episode) -> float:
        await ep.generate()
        i = int(ep.key.split(":")[1])
        if i < len(calls):
            results[i] = (time.time(), await ep.run_python(calls[i].format(run=tmp_path), timeout_s=2.0), time.time())
            ep.append_text("1")
        await ep.generate()
        return 0.0

    with RewardPool(num_workers=1, scorer=MathAnswer()) as pool:
        eps = run_episodes(eng, hostile_tool, tok, pool, _settings(tok), _starts(tok, 12))
    assert all(e.stats.turns == 2 for e in eps)  # every episode went on after its tool call
    assert not Path("/tmp/areal-tool-escape").exists()
    r = {name: results[i][1] for i, name in enumerate(HOSTILE_TOOL_CALLS)}
    assert r["infinite loop"].timed_out and "TimeoutError" in r["infinite loop"].text
    for name in ("fork bomb", "large allocation", "loopback connect", "read the run directory"):
        assert not r[name].ok, (name, r[name])
    assert all("the run's secret" not in x.text and len(x.text) <= 1100 for x in r.values())
    # this process, the sandbox's caller, is alive and no file was written outside (bwrap's /tmp is private)
    # the engine kept stepping while the infinite loop held its episode (2 s)
    t0, _, t1 = results[0]
    assert sum(t0 < t < t1 for t in eng.steps) >= 3
    assert sum(e.stats.tool_calls for e in eps) == len(calls)
    eng.close()


def test_stop_strings_end_an_answer_in_the_torch_engine(tiny_model_dir):
    eng = TorchGenerationEngine(str(tiny_model_dir), seed=6, max_num_seqs=16)
    tok = load_tokenizer(tiny_model_dir)
    prompt = tok.encode("12+7=", add_special_tokens=False)
    reqs = [GenRequest(f"0:{i}", prompt, 30, stop=["+"]) for i in range(16)]
    eng.add(reqs)
    outs = []
    while len(outs) < len(reqs):
        outs += eng.step()
    stopped = [o for o in outs if o.finish_reason == "stop" and tok.decode(o.output_ids).endswith("+")]
    assert stopped, "an untrained model writes '+' within 30 tokens"
    for o in outs:  # no '+' before the end: the first one ends the answer
        assert "+" not in tok.decode(o.output_ids[:-1])
    eng.close()


@pytest.mark.parametrize(
    "source, spec, words",
    [
        ("def reward(:\n", "{f}:reward", "SyntaxError"),
        ("def score(completion, row):\n    return 1.0\n", "{f}:reward", "has no attribute 'reward'"),
        ("def reward(completion):\n    return 1.0\n", "{f}:reward", "cannot be called as f(completion, row)"),
        ("", "no_such_package.rewards:reward", "cannot import 'no_such_package.rewards'"),
    ],
)
def test_a_broken_reward_fn_stops_the_run_in_one_line_before_anything_starts(tmp_path, source, spec, words):
    f = tmp_path / "user_reward.py"
    f.write_text(source)
    run = tmp_path / "run"
    args = [*CLI, "run", str(DEMO), f"reward.fn={spec.format(f=f)}", f"store.run_dir={run}", "model.path=/nonexistent"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and words in r.stderr and "reward.fn" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not run.exists()  # refused before the run directory (or any model or engine) was made


def test_workflows_by_import_path_are_checked(tmp_path):
    f = tmp_path / "flows.py"
    f.write_text("def plain(ep):\n    return 1.0\n\nasync def two(ep, extra):\n    return 1.0\n")
    with pytest.raises(PluginError, match="must be an 'async def' function"):
        load_workflow(f"{f}:plain")
    with pytest.raises(PluginError, match=r"cannot be called as f\(episode\)"):
        load_workflow(f"{f}:two")
    flow = load_workflow(str(ROOT / "jobs/examples/two_turn.py") + ":two_turn")
    assert flow.__name__ == "two_turn"


def test_a_reward_fn_that_hangs_or_raises_scores_zero_and_is_counted(tmp_path):
    f = tmp_path / "flaky.py"
    f.write_text(
        "import time\n"
        "def reward(completion, row):\n"
        "    if completion == 'hang':\n"
        "        while True:\n"
        "            time.sleep(0.01)\n"
        "    if completion == 'raise':\n"
        "        raise ValueError('bad row ' + row['id'])\n"
        "    return float(row['weight'])\n"
    )
    cfg = load_config(None, ["model.path=/m", f"reward.fn={f}:reward", "reward.timeout_s=0.5", "reward.num_workers=1"])
    with reward_pool_for(cfg) as pool:
        rows = [{"id": "a", "weight": 0.75}] * 3
        scores = pool.submit(["ok", "hang", "raise"], rows).result(timeout=60)
    assert list(scores) == [0.75, 0.0, 0.0] and scores.timeouts == 1 and scores.errors == 1


def test_rows_keep_every_field_fill_the_template_or_bring_their_messages(tmp_path, tiny_model_dir):
    import json as _json

    from areal_hpc.data import load_run_dataset

    rows = [
        {"q": "1+2=", "hint": "small", "answer": "3", "difficulty": 1},
        {"messages": [{"role": "user", "content": "2+2="}], "answer": "4", "difficulty": 2},
        {"q": "5+5=", "answer": "10"},  # no hint: skipped, named
        {"q": "3+3=", "hint": "six", "answer": "6", "difficulty": 3},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(_json.dumps(r) for r in rows) + "\n")
    cfg = load_config(
        None,
        [
            "model.path=/m",
            "data.kind=jsonl",
            f"data.path={path}",
            "data.prompt_template='{hint}: {q}'",
            "data.heldout_size=0",
            "data.chat_template=on",
        ],
    )
    with pytest.warns(UserWarning, match=rf"skipped 1 malformed rows .*first at {path}:3: missing or empty 'hint'"):
        ds = load_run_dataset(cfg, load_tokenizer(tiny_model_dir))
    by_answer = {p.answer: p for p in ds.train}
    assert set(by_answer) == {"3", "4", "6"}
    assert by_answer["3"].row == rows[0]  # every field, the ones of its own included
    assert by_answer["3"].prompt == "<user>small: 1+2=<assistant>"
    assert by_answer["4"].prompt == "<user>2+2=<assistant>" and by_answer["4"].row["difficulty"] == 2
    # a reward of its own needs no reference answer: rows without one are kept
    cfg.reward.fn = str(ROOT / "jobs/examples/my_reward.py") + ":reward"
    path.write_text(_json.dumps({"q": "1+1=", "hint": "h"}) + "\n" + _json.dumps({"q": "2+1=", "hint": "h"}) + "\n")
    assert len(load_run_dataset(cfg, load_tokenizer(tiny_model_dir)).train) == 2


async def _branching(ep: Episode) -> float:
    first = await ep.generate()
    ep.branch(ep.prompt_ids + first.ids[:1])  # a new history: the prompt and only the first answer's first token
    await ep.generate()
    return 1.0 if ep.key.endswith(":0") else 0.0


def test_a_workflow_that_rewrites_history_yields_a_sample_per_branch(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    eng = RecordingEngine(str(tiny_model_dir), seed=7, max_num_seqs=8)
    with RewardPool(num_workers=1, scorer=MathAnswer()) as pool:
        eps = run_episodes(eng, _branching, tok, pool, _settings(tok), _starts(tok, 2))
    trajs = [t for k, ep in enumerate(eps) for t in to_trajectories(ep, SampleId(0, k), 0, 0)]
    assert [t.sample_idx for t in trajs] == [0, 0, 1, 1] and [t.reward for t in trajs] == [1.0, 1.0, 0.0, 0.0]
    for k, ep in enumerate(eps):
        outs = sorted((o for rid, o in eng.outputs.items() if rid.episode == ep.key), key=lambda o: o.request_id.call)
        first, second = trajs[2 * k], trajs[2 * k + 1]
        assert first.input_ids.tolist() == outs[0].prompt_ids + outs[0].output_ids
        # the second history starts from a context taken from the first answer: seen, not trained again
        assert second.prompt_len == len(ep.segments[0].ids) == first.prompt_len + 1
        assert second.input_ids.tolist() == outs[1].prompt_ids + outs[1].output_ids
        assert second.loss_mask[: second.prompt_len].sum() == 0 and second.loss_mask[second.prompt_len :].all()
        assert episode_counts(ep, SampleId(0, k)).turns == 2  # the episode's counts: one row for both transcripts
    eng.close()


def test_a_stepped_loop_pass_runs_what_is_ready_once_and_a_parked_waiter_only_when_woken():
    from areal_hpc.workflow.stepped_loop import SteppedLoop

    loop, ran = SteppedLoop(), []
    fut = loop.future()

    async def episode():
        ran.append("started")
        await asyncio.sleep(0)  # what a pass schedules runs at the next pass: a pass is bounded
        ran.append(await loop.wait_woken(fut))

    loop.task(episode())
    loop.run_ready(tasks=1)
    assert ran == ["started"]
    loop.run_once()  # the episode parks on fut
    loop.IDLE_S = -1.0  # every idle pass would be due
    fut.set_result("woken")
    loop.run_ready(tasks=1)  # resolved without wake(): nothing tells the loop, and it waits only for us
    assert ran == ["started"]
    loop.wake()
    loop.run_ready(tasks=1)
    assert ran == ["started", "woken"]
    loop.close()
