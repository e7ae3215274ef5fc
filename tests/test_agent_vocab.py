"""The agent demo's tiny vocabulary (model.vocab=arith_agent): a calculator call spelt in a few tokens that vLLM's
hermes parser reads, a chat template for tool calls and results, the warm start's tool-call episodes, and the
example agent's history as the real openai client sends it."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

from areal_hpc.config import ModelConfig, load_config
from areal_hpc.data import load_run_dataset
from areal_hpc.model import ensure_model, load_tokenizer
from areal_hpc.runtime.build import warm_start
from areal_hpc.workflow.runner import render_turn
from areal_hpc.workflow.warm_start import calculator_call

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo_agent.yaml"
CALL = {"name": "calculator", "arguments": {"expression": "12*34"}}
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": json.dumps(CALL["arguments"])},
}
HISTORY = '<user>12*34=<assistant><tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


def _agent_module():
    spec = importlib.util.spec_from_file_location(
        "calculator_agent", ROOT / "jobs" / "examples" / "calculator_agent.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tokenizer as a run loads it: built by ensure_model into the model folder, then read back from disk."""
    path = tmp_path_factory.mktemp("models") / "tiny-agent"
    return load_tokenizer(ensure_model(ModelConfig(path=str(path), build_tiny=True, vocab="arith_agent")))


@pytest.mark.parametrize("separators", [None, (",", ":"), (", ", ": ")])
def test_a_calculator_call_is_a_few_tokens_whatever_the_json_spacing(tok, separators):
    text = "<tool_call>" + json.dumps(CALL, separators=separators) + "</tool_call>"
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    assert ids == tok.encode(calculator_call("12*34") + "<eos>", add_special_tokens=False)
    assert tok.unk_token_id not in ids and len(ids) == 10  # within the demo's 12 new tokens a turn
    # decoding as the endpoint may (special tokens skipped: only the EOS goes) gives JSON with the same value
    decoded = tok.decode(ids, skip_special_tokens=True)
    assert decoded.startswith("<tool_call>") and decoded.endswith("</tool_call>")
    assert json.loads(decoded.removeprefix("<tool_call>").removesuffix("</tool_call>")) == CALL


def test_vllms_hermes_parser_reads_the_decoded_call_into_one_tool_call(tok):
    parser = Hermes2ProToolParser(tok)
    request = ChatCompletionRequest(model="x", messages=[])
    sampled = tok.encode(calculator_call("12*34"), add_special_tokens=False) + [tok.eos_token_id]
    for skip in (True, False):
        text = tok.decode(sampled, skip_special_tokens=skip).removesuffix("<eos>")
        info = parser.extract_tool_calls(text, request)
        assert info.tools_called and info.content is None, (skip, info)
        (call,) = info.tool_calls
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == CALL["arguments"]
    answer = parser.extract_tool_calls(tok.decode(tok.encode("\\boxed{408}")), request)
    assert not answer.tools_called and answer.content == "\\boxed{408}"


def test_the_template_renders_tool_calls_and_results_and_nothing_for_tools(tok):
    agent = _agent_module()
    first = tok.apply_chat_template(
        [{"role": "user", "content": "12*34="}], tools=[agent.CALCULATOR], add_generation_prompt=True, tokenize=False
    )
    assert first == "<user>12*34=<assistant>"  # the dataset's own prompt: the schema is not rendered
    for assistant in (
        {"role": "assistant", "tool_calls": [TOOL_CALL]},  # as the openai client dumps it: no content
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]},  # arguments as a mapping
    ):
        messages = [{"role": "user", "content": "12*34="}, assistant, {"role": "tool", "content": "408"}]
        text = tok.apply_chat_template(messages, tools=[agent.CALCULATOR], add_generation_prompt=True, tokenize=False)
        assert text == HISTORY + "<eos><tool>408<assistant>", assistant
    answered = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "\\boxed{3}"}]
    assert tok.apply_chat_template(answered, tokenize=False) == "<user>1+2=<assistant>\\boxed{3}<eos>"
    # the history re-rendered tokenizes as the model sampled it (json.dumps's spaces dropped)
    rendered = tok.encode(HISTORY + "<eos>", add_special_tokens=False)
    assert rendered == tok.encode(first + calculator_call("12*34") + "<eos>", add_special_tokens=False)


def test_a_tool_result_after_an_assistant_turn_appends_its_marker_and_the_next_prompt(tok):
    ids = render_turn(tok, "tool", "408", chat=True)
    assert tok.decode(ids) == "<tool>408<assistant>"
    assert ids == [tok.convert_tokens_to_ids(t) for t in ["<tool>", "4", "0", "8", "<assistant>"]]


class _Recorder:
    """A trainer that only records the warm start's sequences."""

    def __init__(self):
        self.seqs, self.masks = [], []

    def supervised_step(self, seqs, masks, lr):
        self.seqs += [s.tolist() for s in seqs]
        self.masks += [m.tolist() for m in masks]
        return 0.0


def test_the_warm_start_writes_a_share_of_calculator_calls_with_untrained_results(tok):
    cfg = load_config(DEMO, ["model.path=/unused", "trainer.warm_start_steps=4", "trainer.warm_start_batch=64"])
    ds = load_run_dataset(cfg, tok)
    recorder = _Recorder()
    warm_start(recorder, tok, ds, cfg, progress=False)
    by_prompt, tool = {tuple(p.prompt_ids): p for p in ds.train}, _agent_module().CALCULATOR
    calls = 0
    for seq, mask in zip(recorder.seqs, recorder.masks):
        p = next(by_prompt[tuple(seq[:n])] for n in range(1, len(seq)) if tuple(seq[:n]) in by_prompt)
        first = [{"role": "user", "content": p.row["question"]}]
        prompt = tok.apply_chat_template(first, tools=[tool], add_generation_prompt=True, tokenize=False)
        assert tok.encode(prompt, add_special_tokens=False) == p.prompt_ids  # the agent's first request
        answer = tok.encode("\\boxed{" + p.answer + "}<eos>", add_special_tokens=False)
        n = len(p.prompt_ids)
        if len(seq) == n + len(answer):  # a direct answer, all trained
            assert seq[n:] == answer and mask == [0] * n + [1] * len(answer)
            continue
        calls += 1
        call = tok.encode(calculator_call(p.row["question"].rstrip("=")) + "<eos>", add_special_tokens=False)
        result = render_turn(tok, "tool", p.answer, chat=True)
        assert seq[n:] == call + result + answer
        assert mask == [0] * n + [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert 0.2 < calls / len(recorder.seqs) < 0.4  # workflow.warm_start_tool_share: 0.3


def test_the_example_agent_sends_a_history_the_template_renders_as_sampled(tok):
    """The agent against the real openai client (a transport standing in for the endpoint): it calls the tool,
    sends the assistant turn back with the result, and returns the final answer."""
    agent, bodies = _agent_module(), []
    replies = [{"content": None, "tool_calls": [TOOL_CALL]}, {"content": "\\boxed{408}"}]

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        message = {"role": "assistant", **replies[len(bodies) - 1]}
        choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if len(bodies) == 1 else "stop"}
        return httpx.Response(
            200, json={"id": "c", "object": "chat.completion", "created": 0, "model": "policy", "choices": [choice]}
        )

    async def run():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        client = openai.AsyncOpenAI(base_url="http://endpoint/v1", api_key="k", http_client=http)
        return await agent.agent(client, {"question": "12*34=", "answer": "408"})

    assert asyncio.run(run()) == "\\boxed{408}"
    assert [b["tools"] for b in bodies] == [[agent.CALCULATOR]] * 2
    second = tok.apply_chat_template(bodies[1]["messages"], add_generation_prompt=True, tokenize=False)
    assert second == HISTORY + "<eos><tool>408<assistant>"
    assert bodies[1]["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "408"}


def test_the_calculator_evaluates_sums_and_products_and_nothing_else():
    calculate = _agent_module().calculate
    assert [calculate(e) for e in ("12*34", "07+15", "3-2*4+1", " 12 * 34 ")] == ["408", "22", "-4", "408"]
    for bad in ("__import__('os')", "2**9", "1/0", "", "9" * 65):
        assert calculate(bad).startswith("error:"), bad


def test_the_agent_demo_loads_and_keeps_the_tool_demos_task():
    cfg = load_config(DEMO, ["model.path=/unused"])
    tool = load_config(ROOT / "jobs" / "demo_tool.yaml", ["model.path=/unused"])
    assert (cfg.workflow.fn, cfg.model.vocab) == ("agent", "arith_agent")
    assert cfg.workflow.agent == f"{ROOT / 'jobs' / 'examples' / 'calculator_agent.py'}:agent"  # made absolute
    assert cfg.data == tool.data and cfg.trainer.max_wall_s == tool.trainer.max_wall_s
    assert np.isclose(cfg.workflow.warm_start_tool_share, tool.workflow.warm_start_tool_share)
