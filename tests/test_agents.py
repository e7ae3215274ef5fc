"""The agent endpoint through the real openai client, over the real torch engine: replies, streams and tool calls,
refusals and keys, stored tokens equal to the sampled ones, branches, failing agents, and the agent settings."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import pickle
import sys
from pathlib import Path

import httpx
import openai
import pytest

from areal_hpc.agents.protocol import OpenAIError, RunSampling, parse_request
from areal_hpc.agents.transcript import ChatRenderer
from areal_hpc.config import Config, ModelConfig, RolloutConfig, WorkflowConfig, load_config
from areal_hpc.data import load_run_dataset
from areal_hpc.engines.torch_gen import TorchGenerationEngine
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.model import build_arith_tokenizer, build_tiny_model, load_tokenizer
from areal_hpc.reward import RewardPool
from areal_hpc.reward.functions import MathAnswer
from areal_hpc.runtime.build import warm_start
from areal_hpc.types import SampleId
from areal_hpc.workflow import RunnerSettings, check_user_code, load_workflow
from areal_hpc.workflow.batch import EpisodeStart, run_episodes
from areal_hpc.workflow.samples import to_trajectories

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
MAX_NEW, MAX_KB = 12, 8  # rollout.max_new_tokens and workflow.max_request_kb of the runs here

_spec = importlib.util.spec_from_file_location("calculator_agent", ROOT / "jobs" / "examples" / "calculator_agent.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

# -- the agents (run as workflow.agent=<this file>:fn, a copy of this module: what they saw is read back through
# the function's globals) ---------------------------------------------------------------------------------------
SEEN: dict[str, dict] = {}  # row id -> what its agent saw
FINISHED: list[str] = []  # keys of agents that returned (their sessions close right after)


async def _streamed(client, **kw) -> dict:
    """One streamed call, parsed by the client: the content, tool calls and finish reason its chunks carry."""
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(model="policy", stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


async def _tool_episode(client, row, seen: dict, stream_first: bool) -> str:
    """A calculator call and its result, then the answer: one of the two calls streamed."""
    messages = [{"role": "user", "content": row["question"]}]
    if stream_first:
        first = seen["first"] = await _streamed(client, messages=messages, tools=[example.CALCULATOR])
        calls = [
            {"id": c["id"], "type": "function", "function": {k: c[k] for k in ("name", "arguments")}}
            for c in first["calls"]
        ]
        messages.append({"role": "assistant", "content": first["content"] or None, "tool_calls": calls})
        results = [example.calculate(json.loads(c["arguments"])["expression"]) for c in first["calls"]]
    else:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[example.CALCULATOR], logprobs=True
        )
        choice = seen["first"] = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        results = [example.run_tool(c) for c in choice.message.tool_calls or []]
        calls = choice.message.tool_calls or []
    for call, result in zip(calls, results):
        call_id = call["id"] if isinstance(call, dict) else call.id
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    seen["results"] = results
    if stream_first:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[example.CALCULATOR])
        second = seen["second"] = {
            "content": reply.choices[0].message.content,
            "finish": reply.choices[0].finish_reason,
        }
    else:
        second = seen["second"] = await _streamed(client, messages=messages, tools=[example.CALCULATOR])
    return second["content"]


async def _short_turn(client, row, seen: dict) -> float:
    """A turn cut at max_tokens, then the user again: the template's end of the turn is glued on untrained."""
    messages = [{"role": "user", "content": row["question"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    seen["finish"] = reply.choices[0].finish_reason
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "1+1="}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    return 0.0


async def _rewrite(client, row, seen: dict) -> float:
    """Another system prompt on the 2nd call (a branch), which the 3rd call extends."""
    first = [{"role": "user", "content": row["question"]}]
    await client.chat.completions.create(model="policy", messages=first, max_tokens=3)
    again = [{"role": "system", "content": "1+1="}, *first]
    reply = await client.chat.completions.create(model="policy", messages=again, max_tokens=3)
    again += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "2+2="}]
    await client.chat.completions.create(model="policy", messages=again, max_tokens=3)
    return 0.0


REFUSED = {  # the field an error names -> the request's extra arguments
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "n": {"n": 2},
    "logit_bias": {"logit_bias": {"5": 10}},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "seed": {"seed": 1},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "response_format": {"response_format": {"type": "json_object"}},
    "tool_choice": {"tools": [example.CALCULATOR], "tool_choice": "required"},
    "max_tokens": {"max_tokens": MAX_NEW + 1},
    "messages": {"messages": [{"role": "user", "content": "1" * 600}]},  # 600 tokens: past the 512 of the model
    "return_token_ids": {"extra_body": {"return_token_ids": "yes"}},
}
TOKEN_REFUSED = {  # the field a token-route error names -> what the request changes
    "sampling_params.temperature": {"temperature": 0.5},
    "sampling_params.stop_token_ids": {"stop_token_ids": [5]},
    "sampling_params.logprobs": {"logprobs": 5},
    "sampling_params.top_k": {"top_k": 3},
    "sampling_params.max_tokens": {"max_tokens": MAX_NEW + 1},
    "stream": {"stream": True},
}


async def _token_route(client, row, seen: dict) -> float:
    """A harness that renders its own prompts: a chat call asking for its token ids, then vLLM's token route on
    the ids it was given plus ids of its own (twice, extending), then ids that rewrite the history (a branch);
    and every refused setting."""
    base, key = str(client.base_url).rstrip("/").removesuffix("/v1"), {"Authorization": f"Bearer {client.api_key}"}
    messages = [{"role": "user", "content": row["question"]}]
    raw = await client.chat.completions.with_raw_response.create(
        model="policy", messages=messages, max_tokens=4, extra_body={"return_token_ids": True}
    )
    seen["chat"] = first = json.loads(raw.content)
    ids = first["prompt_token_ids"] + first["choices"][0]["token_ids"] + row["more"]
    sp = {"max_tokens": 3, "logprobs": 1, "stop_token_ids": row["stop_ids"], "skip_special_tokens": False}
    seen["routes"] = []
    async with httpx.AsyncClient(headers=key) as http:

        async def generate(token_ids, stream=False, **change):
            body = {"token_ids": token_ids, "sampling_params": sp | change, "return_token_ids": True, "stream": stream}
            r = await http.post(f"{base}/inference/v1/generate", json=body)
            return r.status_code, r.json()

        for _ in range(2):
            status, reply = await generate(ids)
            seen["routes"].append(reply)
            ids = reply["prompt_token_ids"] + reply["choices"][0]["token_ids"] + row["more"]
        seen["routes"].append((await generate(first["prompt_token_ids"][:1] + row["more"]))[1])  # a rewrite
        seen["token_refused"] = {}
        for field, change in TOKEN_REFUSED.items():
            status, body = await generate(ids, **change)
            seen["token_refused"][field] = (status, body["error"]["param"], body["error"]["message"])
        status, body = await generate([10**6])
        seen["token_refused"]["token_ids"] = (status, body["error"]["param"], body["error"]["message"])
        async with httpx.AsyncClient() as stranger:
            seen["token_no_key"] = (await stranger.post(f"{base}/inference/v1/generate", json={})).status_code
    return 0.0


async def _status(call) -> tuple:
    try:
        await call
    except openai.APIStatusError as e:
        return type(e).__name__, e.status_code, e.param, e.code, (e.body or {}).get("message", "")
    return ("ok",)


async def _bad_calls(client, row, seen: dict) -> float:
    """Every refused field and bad key, fired from inside an open episode."""
    messages = [{"role": "user", "content": row["question"]}]
    for field, extra in REFUSED.items():
        kw = {"messages": messages, **extra}
        seen[field] = await _status(client.chat.completions.create(model="policy", **kw))
    big = [{"role": "user", "content": "1" * (MAX_KB * 1024 + 1)}]
    seen["too_big"] = await _status(client.chat.completions.create(model="policy", messages=big))
    async with client.chat.completions.with_streaming_response.create(
        model="policy", messages=messages, stream=True, max_tokens=2
    ) as resp:
        seen["sse"] = [line async for line in resp.iter_lines() if line]
    seen["models"] = [m.id async for m in client.models.list()]
    stranger = openai.AsyncOpenAI(base_url=client.base_url, api_key="sk-areal-" + "x" * 43, max_retries=0)
    seen["unknown_key"] = await _status(stranger.chat.completions.create(model="policy", messages=messages))
    base, mine = str(client.base_url).rstrip("/"), {"Authorization": f"Bearer {client.api_key}"}
    async with httpx.AsyncClient() as http:
        seen["raw"] = {
            "chat, no key": (await http.post(f"{base}/chat/completions", json={"messages": messages})).status_code,
            "models, no key": (await http.get(f"{base}/models")).status_code,
            "models, key": (await http.get(f"{base}/models", headers=mine)).status_code,
            "no route, no key": (await http.get(f"{base}/files")).status_code,
            "no route, key": (await http.get(f"{base}/files", headers=mine)).status_code,
        }
        while not FINISHED:  # another episode's agent returns; its key closes with its episode
            await asyncio.sleep(0.01)
        theirs = {"Authorization": f"Bearer {FINISHED[0]}"}
        statuses = [(await http.get(f"{base}/models", headers=theirs)).status_code]
        while statuses[-1] == 200:  # until its episode has ended (this agent's own time limit bounds the wait)
            await asyncio.sleep(0.01)
            statuses.append((await http.get(f"{base}/models", headers=theirs)).status_code)
        seen["finished key"] = statuses[-1]
    done = openai.AsyncOpenAI(base_url=client.base_url, api_key=FINISHED[0], max_retries=0)
    seen["finished key, client"] = await _status(done.chat.completions.create(model="policy", messages=messages))
    return 0.25


async def agent(client: openai.AsyncOpenAI, row: dict):
    seen = SEEN.setdefault(row["id"], {})
    mode = row["mode"]
    if mode == "example":
        result = await example.agent(client, row)
    elif mode in ("plain", "stream"):
        result = await _tool_episode(client, row, seen, stream_first=mode == "stream")
    else:
        modes = {"short": _short_turn, "rewrite": _rewrite, "bad": _bad_calls, "tokens": _token_route}
        result = await modes[mode](client, row, seen)
    FINISHED.append(client.api_key)
    # the agents run in the endpoint's process: what this one saw goes back to the test through a file
    Path(row["out"], f"{row['id']}.pkl").write_bytes(pickle.dumps(seen))
    return result


async def failing_agent(client: openai.AsyncOpenAI, row: dict):
    mode = row["mode"]
    if mode == "hang":
        await asyncio.sleep(1e9)
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["question"]}], max_tokens=2
    )
    if mode == "raise":
        raise ValueError("the agent broke")
    if mode == "garbage":
        return {"answer": reply.choices[0].message.content}
    return 1.0


COMMAND_AGENT = """\
import json, os, sys, time
row = json.loads(sys.stdin.read())
mode = row["mode"]
if mode == "garbage":
    print("the answer is 42")
elif mode == "exit":
    print("something went wrong", file=sys.stderr)
    sys.exit(3)
elif mode == "hang":
    open(row["pidfile"], "w").write(str(os.getpid()))
    time.sleep(1e9)
else:
    import openai
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    messages = [{"role": "user", "content": row["question"]}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    print("calling done")
    print(json.dumps({"reward": 0.5} if mode == "reward" else {"answer": "\\\\boxed{" + row["answer"] + "}"}))
"""


# -- the model, engine and runs -----------------------------------------------------------------------------------
class RecordingEngine(TorchGenerationEngine):
    """The torch engine, keeping every output it returned by request id ("{episode key}#{n}")."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.outputs = {}

    def step(self):
        outs = super().step()
        self.outputs.update((o.request_id, o) for o in outs)
        return outs


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory):
    """A tiny arith_agent model warm-started by the real trainer on calculator calls only (a few steps), so that
    greedy episodes call the tool: (folder, tokenizer, weights published as version 1)."""
    path = build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-agent", tokenizer=build_arith_tokenizer(vocab="arith_agent")
    )
    tok = load_tokenizer(path)
    over = ["workflow.warm_start_tool_share=1.0", "trainer.warm_start_steps=30", "trainer.warm_start_batch=16"]
    cfg = load_config(ROOT / "jobs" / "demo_agent.yaml", ["model.path=/unused", *over])
    trainer = TorchTrainEngine(str(path), lr=cfg.trainer.warm_start_lr, weight_decay=0.0, seed=0)
    warm_start(trainer, tok, load_run_dataset(cfg, tok), cfg, progress=False)
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return path, tok, weights


def _run(agent_model, rows: list[dict], greedy=False, **workflow):
    """The agent workflow on one batch of rows (no retries): (engine, finished episodes)."""
    path, tok, weights = agent_model
    eng = RecordingEngine(str(path), seed=7, max_num_seqs=8)
    eng.update_weights(weights, 1)
    wc = WorkflowConfig(**workflow)
    cfg = Config(model=ModelConfig(path=str(path)), rollout=RolloutConfig(max_new_tokens=MAX_NEW), workflow=wc)
    settings = RunnerSettings(wc, max_new_tokens=MAX_NEW, max_context=512, chat=True, sandbox="auto", config=cfg)
    starts = []
    for i, row in enumerate(rows):
        text = tok.apply_chat_template(
            [{"role": "user", "content": row["question"]}], add_generation_prompt=True, tokenize=False
        )
        starts.append(EpisodeStart(str(SampleId(0, i)), row, tok.encode(text, add_special_tokens=False), greedy))
    with RewardPool(num_workers=1, scorer=MathAnswer()) as pool:  # reward.fn: math, on the row's answer
        eps = run_episodes(eng, load_workflow("agent"), tok, pool, settings, starts, retry=False)
    eng.close()
    return eng, eps


def _outputs(eng, key: str) -> list:
    mine = [o for rid, o in eng.outputs.items() if rid.episode == key]
    return sorted(mine, key=lambda o: o.request_id.call)


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) spans of mask 1."""
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _check_sampled(traj, outs) -> list[list[int]]:
    """The trajectory is the tokens the engine saw and sampled: each output's prompt is the transcript up to its
    tokens, which are trained with their logprobs and versions; nothing else is. The untrained pieces between."""
    ids, mask = traj.input_ids.tolist(), traj.loss_mask.tolist()
    spans = _runs(mask)
    assert len(spans) == len(outs)
    for (s, e), o in zip(spans, outs):
        assert ids[:s] == list(o.prompt_ids) and ids[s:e] == list(o.output_ids)
        assert traj.behav_logprobs[s:e].tolist() == pytest.approx(list(o.output_logprobs))
        assert traj.versions[s:e].tolist() == list(o.output_versions) == [1] * (e - s)
    off = traj.loss_mask == 0
    assert (traj.versions[off] == -1).all() and (traj.behav_logprobs[off] == 0).all()
    return [ids[e:s] for (_, e), (s, _) in zip(spans, spans[1:])]


ROWS = [
    {"id": "example", "mode": "example", "question": "12*34=", "answer": "408"},
    {"id": "plain", "mode": "plain", "question": "56*78=", "answer": "4368"},
    {"id": "stream", "mode": "stream", "question": "23*45=", "answer": "1035"},
    {"id": "short", "mode": "short", "question": "12*34=", "answer": "408"},
    {"id": "rewrite", "mode": "rewrite", "question": "12*34=", "answer": "408"},
    {"id": "bad", "mode": "bad", "question": "12*34=", "answer": "408"},
    {"id": "tokens", "mode": "tokens", "question": "12*34=", "answer": "408"},
]


@pytest.fixture(scope="module")
def agent_run(agent_model, tmp_path_factory):
    """One greedy batch of the agents above, through the in-process form: (tokenizer, engine, episodes by row id,
    what each agent saw)."""
    out, tok = tmp_path_factory.mktemp("seen"), agent_model[1]
    more = tok.encode("<user>1+1=<assistant>", add_special_tokens=False)  # what the token harness appends
    rows = [dict(r, out=str(out), more=more, stop_ids=[tok.eos_token_id]) for r in ROWS]
    eng, eps = _run(agent_model, rows, greedy=True, agent=f"{THIS}:agent", max_request_kb=MAX_KB)
    seen = {r["id"]: pickle.loads((out / f"{r['id']}.pkl").read_bytes()) for r in ROWS}
    return agent_model[1], eng, {r["id"]: (k, ep) for k, (r, ep) in enumerate(zip(ROWS, eps))}, seen


def test_replies_streams_and_tool_calls_through_the_openai_client(agent_run):
    tok, eng, eps, seen = agent_run
    (_, plain), first = eps["plain"], seen["plain"]["first"]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    assert call.function.name == "calculator" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"expression"}
    sampled = _outputs(eng, plain.key)
    assert tok.decode(sampled[0].output_ids, skip_special_tokens=True).startswith("<tool_call>")
    # logprobs: true gives each sampled token's logprob (its EOS included)
    assert [c.logprob for c in first.logprobs.content] == pytest.approx(sampled[0].output_logprobs)
    streamed = seen["plain"]["second"]  # the answer after the tool result, streamed
    assert streamed["finish"] == "stop" and streamed["content"].startswith("\\boxed{") and not streamed["calls"]
    assert streamed["content"] == tok.decode(sampled[1].output_ids, skip_special_tokens=True)
    # a streamed tool call: the name and arguments in its chunks, finish_reason tool_calls
    first = seen["stream"]["first"]
    assert first["finish"] == "tool_calls" and [c["name"] for c in first["calls"]] == ["calculator"]
    assert set(json.loads(first["calls"][0]["arguments"])) == {"expression"}
    assert seen["stream"]["second"]["finish"] == "stop"
    # the stream as it went over the wire: chat.completion.chunk events, then [DONE]
    sse = seen["bad"]["sse"]
    assert sse[-1] == "data: [DONE]" and all(line.startswith("data: {") for line in sse[:-1])
    assert {json.loads(line[6:])["object"] for line in sse[:-1]} == {"chat.completion.chunk"}
    # the example agent's answers are scored by the run's reward; a float is the reward as it is
    (_, ex), (_, bad) = eps["example"], eps["bad"]
    final = tok.decode(_outputs(eng, ex.key)[-1].output_ids, skip_special_tokens=True)
    assert ex.reward == float(final == "\\boxed{408}") and bad.reward == 0.25
    assert ex.stats.turns == 2 and ex.stats.agent_failures == 0


def test_every_refused_field_is_a_400_naming_it(agent_run):
    seen = agent_run[3]["bad"]
    for field in REFUSED:
        kind, status, param, code, message = seen[field]
        assert (kind, status, param) == ("BadRequestError", 400, field), (field, seen[field])
        assert message.startswith(f"{field}: ") or code == "context_length_exceeded", (field, message)
    assert "logprobs must be those of the policy" in seen["temperature"][4]
    assert seen["messages"][3] == "context_length_exceeded" and "maximum context length is 512" in seen["messages"][4]
    assert seen["max_tokens"][4].endswith(f"rollout.max_new_tokens={MAX_NEW}")
    assert seen["too_big"][:2] == ("APIStatusError", 413)


def test_every_bad_key_is_refused_and_nothing_is_reachable_without_one(agent_run):
    seen = agent_run[3]["bad"]
    assert seen["models"] == ["tiny-agent"]  # GET /v1/models with the episode's key: the model folder's name
    assert seen["unknown_key"][:2] == ("AuthenticationError", 401)
    assert seen["raw"] == {
        "chat, no key": 401,
        "models, no key": 401,
        "models, key": 200,
        "no route, no key": 401,
        "no route, key": 404,
    }
    assert seen["finished key"] == 401
    assert seen["finished key, client"][:2] == ("AuthenticationError", 401)


def test_stored_trajectories_are_the_sampled_tokens_with_rendered_messages_untrained(agent_run):
    tok, eng, eps, seen = agent_run
    for name, (k, ep) in eps.items():
        trajs = to_trajectories(ep, SampleId(0, k), 0, 0)
        outs = _outputs(eng, ep.key)
        n = [len(_runs(t.loss_mask.tolist())) for t in trajs]
        assert sum(n) == len(outs) == ep.stats.turns, name
        pieces = [_check_sampled(t, outs[sum(n[:i]) : sum(n[: i + 1])]) for i, t in enumerate(trajs)]
        if name in ("plain", "stream", "example"):
            (between,) = pieces[0]
            assert outs[0].output_ids[-1] == tok.eos_token_id  # the model closed its turn: nothing added
            result = seen[name]["results"][0] if name != "example" else _example_result(tok, outs[0])
            assert tok.decode(between) == f"<tool>{result}<assistant>"
            assert trajs[0].reward == ep.reward
    # a turn cut at max_tokens: the <eos> the template closes it with is glued on, untrained
    k, short = eps["short"]
    assert seen["short"]["finish"] == "length"
    (between,) = _check_sampled(to_trajectories(short, SampleId(0, k), 0, 0)[0], _outputs(eng, short.key))
    assert _outputs(eng, short.key)[0].output_ids[-1] != tok.eos_token_id
    assert tok.decode(between) == "<eos><user>1+1=<assistant>"


def test_a_rewritten_history_becomes_a_branch(agent_run):
    tok, eng, eps, _ = agent_run
    k, ep = eps["rewrite"]
    assert ep.stats.branches == 1 and sum(e.stats.branches for n, (_, e) in eps.items() if n != "tokens") == 1
    first, second = to_trajectories(ep, SampleId(0, k), 0, 0)
    outs = _outputs(eng, ep.key)
    assert _check_sampled(first, outs[:1]) == [] and len(_check_sampled(second, outs[1:])) == 1
    assert tok.decode(first.input_ids[: first.prompt_len].tolist()) == "<user>12*34=<assistant>"
    assert tok.decode(second.input_ids[: second.prompt_len].tolist()) == "<system>1+1=<user>12*34=<assistant>"
    assert first.reward == second.reward == 0.0


def test_the_token_route_and_token_fields_answer_with_the_sampled_tokens_on_the_episodes_transcript(agent_run):
    tok, eng, eps, seen = agent_run
    k, ep = eps["tokens"]
    seen = seen["tokens"]
    outs = _outputs(eng, ep.key)
    assert len(outs) == 4 and ep.stats.branches == 1  # a chat call, two token calls extending it, a rewrite
    # chat completions with return_token_ids: vLLM's fields and NeMo-Gym's, as the engine saw and sampled them
    chat, o = seen["chat"], outs[0]
    msg, choice = chat["choices"][0]["message"], chat["choices"][0]
    assert chat["prompt_token_ids"] == msg["prompt_token_ids"] == list(o.prompt_ids)
    assert choice["token_ids"] == msg["generation_token_ids"] == list(o.output_ids)
    assert msg["generation_log_probs"] == pytest.approx(list(o.output_logprobs))
    assert choice["weight_versions"] == [{"version": "1", "start": 0, "end": len(o.output_ids)}]
    # the token route: the harness's ids are the engine's prompt, its answer the engine's output
    for reply, o in zip(seen["routes"], outs[1:]):
        (c,) = reply["choices"]
        assert reply["prompt_token_ids"] == list(o.prompt_ids) and c["token_ids"] == list(o.output_ids)
        assert [e["token"] for e in c["logprobs"]["content"]] == [f"token_id:{t}" for t in o.output_ids]
        assert [e["token_id"] for e in c["logprobs"]["content"]] == list(o.output_ids)
        assert [e["logprob"] for e in c["logprobs"]["content"]] == pytest.approx(list(o.output_logprobs))
        assert c["weight_versions"] == [{"version": "1", "start": 0, "end": len(o.output_ids)}]
        assert c["finish_reason"] in ("stop", "length") and reply["output_mode"] == "tokens"
    # stored: the chat turn and both token turns in one transcript, the rewrite a sample of its own
    first, second = to_trajectories(ep, SampleId(0, k), 0, 0)
    between = _check_sampled(first, outs[:3])
    assert [tok.decode(b) for b in between] == ["<user>1+1=<assistant>"] * 2
    assert _check_sampled(second, outs[3:]) == []
    assert tok.decode(second.input_ids[: second.prompt_len].tolist()) == "<user><user>1+1=<assistant>"
    # every setting the run cannot honour: a 400 naming it; no key, no route
    for field, (status, param, message) in seen["token_refused"].items():
        assert (status, param) == (400, field) and message.startswith(f"{field}: "), (field, message)
    assert "it ends at [" in seen["token_refused"]["sampling_params.stop_token_ids"][2]
    assert f"1000000 is not a token id of this model (0 to {len(tok) - 1})" in seen["token_refused"]["token_ids"][2]
    assert seen["token_no_key"] == 401


def _example_result(tok, sampled) -> str:
    """What the example agent's calculator gave for the call the model sampled."""
    text = tok.decode(sampled.output_ids, skip_special_tokens=True)
    call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    return example.calculate(call["arguments"]["expression"])


def _failures_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if " failed: the agent " in r.getMessage()]


def test_an_agent_that_hangs_raises_or_returns_garbage_costs_its_episode_only(agent_model, caplog):
    caplog.set_level(logging.WARNING, logger="areal_hpc.workflow")
    modes = ["hang", "raise", "raise", "garbage", "ok", "ok"]
    rows = [{"mode": m, "question": "12*34=", "answer": "408"} for m in modes]
    _, eps = _run(agent_model, rows, agent=f"{THIS}:failing_agent", agent_timeout_s=10)
    assert [e.reward for e in eps] == [None] * 4 + [1.0, 1.0]
    assert [e.stats.agent_failures for e in eps] == [1, 1, 1, 1, 0, 0]
    kinds = [e.failure and e.failure.kind for e in eps]
    assert kinds == ["timed out", "raised", "raised", "bad result", None, None]
    raised_at = next(i for i, ln in enumerate(Path(__file__).read_text().splitlines(), 1) if 'the agent broke")' in ln)
    assert eps[1].failure.where.endswith(f"test_agents.py:{raised_at}"), eps[1].failure  # the agent's own line
    logged = _failures_logged(caplog)
    assert len(logged) == 3  # one per kind and place: the second raise is counted, not logged again
    for words in ("workflow.agent_timeout_s=10", "raised: ValueError: the agent broke at", "returned {'answer'"):
        assert sum(words in m for m in logged) == 1, (words, logged)


def test_a_command_agent_reports_a_reward_or_an_answer_and_its_failures_cost_one_episode(agent_model, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="areal_hpc.workflow")
    script = tmp_path / "agent.py"
    script.write_text(COMMAND_AGENT)
    pidfile = tmp_path / "hang.pid"
    modes = ["garbage", "exit", "hang", "answer", "reward"]
    rows = [{"mode": m, "question": "12*34=", "answer": "408", "pidfile": str(pidfile)} for m in modes]
    _, eps = _run(agent_model, rows, agent_command=f"{sys.executable} {script}", agent_timeout_s=30)
    assert [e.reward for e in eps] == [None, None, None, 1.0, 0.5]
    assert [e.stats.agent_failures for e in eps] == [1, 1, 1, 0, 0]
    assert [e.failure.kind for e in eps[:3]] == ["bad result", "raised", "timed out"]
    assert [e.stats.turns for e in eps[3:]] == [1, 1]  # the commands called the endpoint with their key
    logged = _failures_logged(caplog)
    assert len(logged) == 3 and sum("agent_timeout_s=30" in m for m in logged) == 1, logged  # one of each kind
    assert any("printed 'the answer is 42' last" in m for m in logged), logged
    assert any("exited with status 3: something went wrong" in m for m in logged), logged
    with pytest.raises(ProcessLookupError):  # the hanging command was killed at its time limit
        os.kill(int(pidfile.read_text()), 0)


AGENT_FILE = """\
async def good(client, row):
    return 1.0

def plain(client, row):
    return 1.0

async def one(client):
    return 1.0
"""


@pytest.mark.parametrize(
    "overrides, words",
    [
        ([], "needs exactly one of workflow.agent"),
        (["workflow.agent={f}:good", "workflow.agent_command=python a.py"], "both are set"),
        (["workflow.agent=/nonexistent/agent.py:good"], "does not exist"),
        (["workflow.agent={f}:missing"], "has no attribute 'missing'"),
        (["workflow.agent={f}:plain"], "must be an 'async def' function"),
        (["workflow.agent={f}:one"], "cannot be called as f(client, row)"),
        (["workflow.agent={f}:good", "workflow.tool_parser=nosuch"], "workflow.tool_parser='nosuch'"),
        (["workflow.agent={f}:good", "workflow.agent_timeout_s=0"], "workflow.agent_timeout_s=0"),
        (["workflow.agent={f}:good", "workflow.agent_timeout_s=-1"], "workflow.agent_timeout_s=-1"),
        (["workflow.agent={f}:good", "workflow.max_request_kb=0"], "workflow.max_request_kb=0"),
        (["workflow.agent_command=no-such-program-here a.py"], "is not a program found on PATH"),
        (["workflow.agent_command=python 'unclosed"], "does not split into words"),
        (["workflow.agent=not-a-path"], "is not an import path"),
        (["workflow.agent={f}:good", 'workflow.endpoint_host=" "'], "workflow.endpoint_host is empty"),
    ],
)
def test_every_bad_agent_setting_is_one_line(tmp_path, overrides, words):
    f = tmp_path / "agents.py"
    f.write_text(AGENT_FILE)
    args = ["model.path=/m", "workflow.fn=agent", *(o.format(f=f) for o in overrides)]
    with pytest.raises(ValueError) as err:
        check_user_code(load_config(None, args))
    message = str(err.value)
    assert words in message and "workflow." in message and "\n" not in message, message


def test_a_good_agent_setting_passes_the_checks(tmp_path):
    f = tmp_path / "agents.py"
    f.write_text(AGENT_FILE)
    for setting in (f"workflow.agent={f}:good", f"workflow.agent_command={sys.executable} agent.py"):
        check_user_code(load_config(None, ["model.path=/m", "workflow.fn=agent", setting]))


def test_an_agent_setting_without_the_agent_workflow_is_one_line():
    with pytest.raises(ValueError, match="^config workflow.agent / workflow.agent_command name an agent, but"):
        load_config(None, ["model.path=/m", "workflow.agent=x.py:f"])


def test_messages_after_an_assistant_turn_render_alone_when_the_template_changes_a_last_turn():
    """A Qwen3-shaped template writes an empty think block into the LAST assistant turn only: the turn renders
    differently once messages follow it, and the messages after it still render on their own."""
    tok = build_arith_tokenizer(vocab="arith_agent")
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant>"
        "{% if loop.last %}<system><system>{% endif %}{{ m['content'] }}<eos>"
        "{% else %}<{{ m['role'] }}>{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    renderer = ChatRenderer(tok)
    ids = renderer.extension([{"role": "tool", "content": "408"}], None, "none")
    assert tok.decode(ids) == "<tool>408<assistant>"
    assert tok.convert_ids_to_tokens(renderer.turn_end) == ["<eos>"]


async def cancels_its_call(ep) -> float:
    """A workflow whose generate call is cancelled alone once in the engine, as an agent's call is when its
    session closes: the episode goes on and ends."""
    call = asyncio.ensure_future(ep.generate(max_new_tokens=MAX_NEW))
    await asyncio.sleep(0)  # the call's request reaches the engine
    call.cancel()
    return 0.0


def test_a_call_cancelled_alone_leaves_the_engine(agent_model):
    path, tok, weights = agent_model
    eng = RecordingEngine(str(path), seed=7, max_num_seqs=8)
    settings = RunnerSettings(WorkflowConfig(), max_new_tokens=MAX_NEW, max_context=512, chat=True, sandbox="auto")
    ids = tok.encode("<user>12*34=<assistant>", add_special_tokens=False)
    starts = [EpisodeStart(str(SampleId(0, i)), {"question": "12*34="}, ids) for i in range(3)]
    with RewardPool(num_workers=1, scorer=MathAnswer()) as pool:
        eps = run_episodes(eng, cancels_its_call, tok, pool, settings, starts, retry=False)
    assert [e.reward for e in eps] == [0.0] * 3
    assert eng.num_running == 0 and eng.num_waiting == 0  # interrupted, not left to run to its length limit
    eng.close()


def test_tools_of_the_wrong_shape_and_fields_not_served_are_refused_before_anything_runs():
    run = RunSampling(1.0, 1.0, MAX_NEW, "tiny")
    msgs = [{"role": "user", "content": "1+1="}]
    for extra, param in (
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"stream": "false"}, "stream"),
    ):
        with pytest.raises(OpenAIError) as err:
            parse_request({"messages": msgs} | extra, run)
        assert err.value.status == 400 and err.value.param == param, (extra, err.value)
    # max_completion_tokens: null leaves max_tokens in force
    assert parse_request({"messages": msgs, "max_completion_tokens": None, "max_tokens": 3}, run).max_tokens == 3


def test_the_pipe_carries_typed_records_and_refuses_a_bad_one_in_one_line():
    import multiprocessing

    from areal_hpc.agents import pipe
    from areal_hpc.agents.protocol import ChatRequest
    from areal_hpc.agents.running import AgentOutcome

    here, there = multiprocessing.Pipe()
    call = pipe.ChatCall(3, "sk-areal-x", ChatRequest([{"role": "user", "content": "1+1="}]), 12.5)
    pipe.send(there, call, pipe.TO_GENERATOR)
    assert pipe.receive(here, pipe.TO_GENERATOR) == call
    pipe.send(there, pipe.AgentDone("sk-areal-x", AgentOutcome(1.0)), pipe.TO_GENERATOR)
    assert pipe.receive(here, pipe.TO_GENERATOR).outcome.value == 1.0
    for msg, allowed, words in (
        (pipe.Ready("8000"), pipe.TO_GENERATOR, "Ready.port is a str, the protocol says int"),
        (pipe.CallRefused(1, "no"), pipe.TO_HOST, "CallRefused.error is a str, the protocol says OpenAIError"),
        (
            pipe.Quit(),
            pipe.TO_GENERATOR,
            "a Quit where the protocol carries Ready, Failed, ChatCall, TokenCall, AgentDone",
        ),
        (("start", "k", {}), pipe.TO_HOST, "a tuple where the protocol carries StartAgent"),
    ):
        with pytest.raises(pipe.PipeError) as err:
            pipe.send(there, msg, allowed)
        assert words in str(err.value) and "\n" not in str(err.value)
    there.send(pipe.StartAgent("k", {}))  # sent unchecked: the receiver checks too
    with pytest.raises(pipe.PipeError, match="a StartAgent where"):
        pipe.receive(here, pipe.TO_GENERATOR)
    here.close()
    there.close()


def test_the_pipe_table_in_its_docstring_is_the_records_in_code():
    from dataclasses import fields

    from areal_hpc.agents import pipe

    lines = {ln.split()[0]: ln for ln in pipe.__doc__.splitlines() if ln.startswith("  ") and ln.split()}
    for record in pipe.TO_HOST + pipe.TO_GENERATOR:
        names = [f.name for f in fields(record)]
        row = lines[record.__name__].split(None, 1)[1:] or [""]
        assert [w.strip(",") for w in row[0].split()[: len(names)]] == names, record.__name__
