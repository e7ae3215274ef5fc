"""End to end under mpirun: the calculator agent written with the OpenAI Agents SDK trains through the endpoint."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_runtime import _audit, _no_leaks
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

from areal_hpc.config import load_config
from areal_hpc.launch.local import launch
from areal_hpc.model import load_tokenizer
from areal_hpc.store import list_shards
from areal_hpc.store.shards import read_columns
from areal_hpc.workflow.runner import render_turn

ROOT = Path(__file__).resolve().parents[1]
SDK_AGENT = ROOT / "jobs" / "examples" / "calculator_agent_sdk.py"
COMMAND_AGENT = ROOT / "tests" / "data" / "calculator_agent_cmd.py"
VERSIONS = 3


def _sampled_runs(t) -> list[tuple[int, int]]:
    """(start, end) of each run of sampled tokens (loss mask 1) in a trajectory."""
    m = np.r_[0, t.loss_mask, 0]
    edges = np.flatnonzero(np.diff(m))
    return list(zip(edges[::2], edges[1::2]))


def _call(parser, text: str) -> dict | None:
    """The one tool call in a sampled turn as the endpoint reads it (vLLM's hermes parser), or None for an answer."""
    info = parser.extract_tool_calls(text, ChatCompletionRequest(model="policy", messages=[]))
    if not info.tools_called:
        return None
    (call,) = info.tool_calls  # one call fits in a turn of rollout.max_new_tokens=12
    return {"name": call.function.name, "arguments": json.loads(call.function.arguments)}


@functools.cache
def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sdk_result(call: dict) -> str:
    """What the SDK agent's calculator answers to one sampled call, as its function tool computes it."""
    try:
        return str(_module(SDK_AGENT).evaluate(call["arguments"]["expression"]))
    except ValueError as error:
        return f"error: {error}"


def _stored(run: Path) -> list[tuple]:
    """Every stored trajectory with its episode's tool calls, from its shard's episode table."""
    out = []
    for p in list_shards(run / "rollouts"):
        c = read_columns(p)
        e = {k: c.episodes[k].tolist() for k in ("group_id", "sample_idx", "tool_calls")}
        calls = dict(zip(zip(e["group_id"], e["sample_idx"]), e["tool_calls"]))
        out += [(t, calls[t.group_id, t.sample_idx]) for t in c.trajectories()]
    return out


def _check_trajectory(stored: tuple, tok, parser, tool_result) -> int:
    """A stored trajectory of the calculator agent and its episode's tool calls (no branch here: one transcript
    each) checked token for token; its number of tool calls.
    Sampled tokens carry the version that sampled them and their behaviour logprob, nothing else does; every turn
    but the last is a calculator call, followed by exactly the tool's result as the chat template renders it
    (`tool_result(call)`: the agent's own answer to it) and the next assistant prompt, never trained."""
    t, tool_calls = stored
    runs, sampled = _sampled_runs(t), t.loss_mask == 1
    assert (t.versions[sampled] >= 0).all() and (t.behav_logprobs[sampled] <= 0).all()
    assert (t.behav_logprobs[sampled] < 0).any()
    assert (t.versions[~sampled] == -1).all() and (t.behav_logprobs[~sampled] == 0).all()
    assert runs and runs[0][0] == t.prompt_len and t.loss_mask[runs[-1][1] :].sum() == 0
    question = tok.decode(t.input_ids[: t.prompt_len].tolist())
    assert re.fullmatch(r"<user>\d\d\*\d\d=<assistant>", question), question
    # the endpoint reads the model's text as vLLM's server does: special tokens (a <pad> sampled at temperature 1
    # inside the arguments, say) left out
    texts = [tok.decode(t.input_ids[a:b].tolist(), skip_special_tokens=True) for a, b in runs]
    for text, (_, b), (c, _) in zip(texts, runs, runs[1:]):
        call = _call(parser, text)
        assert call is not None and call["name"] == "calculator", text
        # the template closes the turn with <eos>: appended unless the model sampled it (a turn cut at its length)
        closing = [] if t.input_ids[b - 1] == tok.eos_token_id else [tok.eos_token_id]
        assert t.input_ids[b:c].tolist() == closing + render_turn(tok, "tool", tool_result(call), chat=True)
    final = texts[-1]
    # each assistant turn with tool_calls is counted (the last one too, where the agent ran out of turns)
    assert tool_calls == len(runs) - 1 + (_call(parser, final) is not None)
    a, b = map(int, re.findall(r"\d\d", question))
    assert t.reward in (0.0, 1.0), t.reward
    assert (final == f"\\boxed{{{a * b}}}") <= (t.reward == 1.0) <= (str(a * b) in final), (question, final, t.reward)
    return tool_calls


def short_agent_demo(agent: str, run: Path, model: Path, versions: int, eval_prompts: int = 10) -> list[str]:
    """Overrides of jobs/demo_agent.yaml for a short run: one generator, 8 groups a version, a fixed number of
    groups per version (the run's cost is known), versions rather than seconds."""
    return [
        f"workflow.agent={agent}",
        f"store.run_dir={run}",
        f"model.path={model}",
        f"trainer.versions={versions}",
        "trainer.max_wall_s=0",
        "rollout.batch_prompts=8",
        "rollout.max_concurrent_groups=8",
        "ppo.drop_uniform_groups=false",
        "cluster.n_generators=1",
        "logging.eval_every=0",
        f"logging.eval_prompts={eval_prompts}",
        "logging.trackers=[]",
    ]


def test_the_agents_sdk_calculator_agent_trains_on_exactly_the_tokens_it_sampled(tmp_path, monkeypatch):
    """jobs/demo_agent.yaml with the framework-written agent, a few versions: each episode is one Runner.run of
    the SDK against the episode's endpoint session, and what is stored is the sampled tokens (with their versions
    and logprobs) and, between them, the calculator's result as the chat template renders it, never trained."""
    pytest.importorskip("agents", reason="the OpenAI Agents SDK is the `agents` extra (env/setup.sh installs it)")
    monkeypatch.chdir(ROOT)  # the demo's agent path is relative to the repository root
    run = tmp_path / "run"
    overrides = short_agent_demo(f"{SDK_AGENT}:agent", run, tmp_path / "model", VERSIONS)
    cfg = load_config(ROOT / "jobs" / "demo_agent.yaml", [*overrides, "logging.progress=false"])
    s = launch(cfg, progress=False)
    assert s["versions"] == VERSIONS and s["failure"] is None
    # no agent failed, and the SDK's history (its assistant turns sent back as it got them) always extended
    # the session's transcript: no branch
    assert s["agent_failures"] == 0 and s["branches"] == 0
    eaten = _audit(run, eta=cfg.rollout.eta)  # exactly once, within the staleness bound
    assert len(eaten) == VERSIONS * 8 * cfg.rollout.n_samples

    tok = load_tokenizer(tmp_path / "model")
    trajectories = _stored(run)
    parser = Hermes2ProToolParser(tok)
    calls = sum(_check_trajectory(t, tok, parser, _sdk_result) for t in trajectories)
    assert calls > 0, "the warm-started policy never called the calculator"

    m = pd.read_csv(run / "metrics.csv")
    assert {"branches", "agent_failures"} <= set(m.columns)
    trained = m[m["samples"].notna()]
    assert len(trained) == VERSIONS
    assert trained["agent_failures"].sum() == 0 and trained["branches"].sum() == 0
    assert trained["tool_calls"].sum() > 0 and (trained["turns_mean"] > 1).all()
    assert s["tool_share_start"] is not None and s["acc_final"] is not None
    _no_leaks(run)  # the endpoint's process and the reward pool ended cleanly with the generator


def test_an_agent_command_per_episode_trains_through_the_endpoint(tmp_path):
    """workflow.agent_command: a script with no client library (urllib) started once per episode, the row on its
    stdin, the endpoint and key in its environment, its answer on stdout, sending the assistant messages back as
    it got them."""
    run = tmp_path / "run"
    cfg = load_config(
        ROOT / "jobs" / "demo_agent.yaml",
        [
            "workflow.agent=''",  # the demo's in-process agent off: exactly one form
            f"workflow.agent_command={sys.executable} {COMMAND_AGENT}",
            f"store.run_dir={run}",
            f"model.path={tmp_path / 'model'}",
            "trainer.versions=2",
            "trainer.max_wall_s=0",
            "rollout.batch_prompts=4",
            "rollout.max_concurrent_groups=4",
            "ppo.drop_uniform_groups=false",
            "cluster.n_generators=1",
            "logging.eval_every=0",
            "logging.eval_prompts=4",
            "logging.progress=false",
            "logging.trackers=[]",
        ],
    )
    s = launch(cfg, progress=False)
    assert s["versions"] == 2 and s["failure"] is None
    assert s["agent_failures"] == 0 and s["branches"] == 0
    eaten = _audit(run, eta=cfg.rollout.eta)
    assert len(eaten) == 2 * 4 * cfg.rollout.n_samples
    tok, agent = load_tokenizer(tmp_path / "model"), _module(COMMAND_AGENT)
    trajectories = _stored(run)
    parser, result = Hermes2ProToolParser(tok), lambda call: agent.product(json.dumps(call["arguments"]))
    calls = sum(_check_trajectory(t, tok, parser, result) for t in trajectories)
    assert calls > 0, "the warm-started policy never called the calculator"
    m = pd.read_csv(run / "metrics.csv")
    assert m["agent_failures"].sum() == 0 and m["tool_calls"].sum() > 0
    _no_leaks(run)
