"""The OpenAI chat-completions wire format: a request checked into a typed record, and replies, chunks and errors."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields that would change what the model sees or how it samples, and that this endpoint does not serve
NOT_SERVED = {
    "functions": "the legacy functions API is not served; send them as `tools`",
    "function_call": "the legacy functions API is not served; use `tool_choice`",
    "audio": "audio output is not served",
    "prediction": "predicted outputs are not served",
    "web_search_options": "web search is not served",
    "reasoning_effort": "is not served: the policy samples as it was trained; leave it out",
}


class OpenAIError(Exception):
    """A request the run cannot honour: HTTP `status` with OpenAI's error body, `param` naming the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def __reduce__(self):  # it crosses the endpoint's pipe
        return (OpenAIError, (self.status, str(self), self.param, self.code))

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def refused(param: str, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param, code)


@dataclass
class RunSampling:
    """What the run samples with: a request may repeat these values, never change them."""

    temperature: float
    top_p: float
    max_new_tokens: int  # rollout.max_new_tokens: the most one call may ask for
    model_name: str  # what GET /v1/models lists


@dataclass
class ChatRequest:
    """A checked chat-completions request: only what this endpoint acts on."""

    messages: list[dict]  # each normalised (see `normal_message`)
    tools: list[dict] | None = None
    tool_choice: str = "auto"  # auto | none
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    logprobs: bool = False
    model: str = ""
    return_token_ids: bool = False  # the token ids and logprobs in the reply (vLLM's and NeMo-Gym's fields)


def _text(content, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("text", "input_text", "output_text"):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise refused(where, f"only text content is served (a part of type {kind!r} was sent)")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise refused(where, f"must be a string or a list of text parts, not {type(content).__name__}")


def _arguments(raw) -> str:
    """A tool call's arguments as canonical JSON text, so that re-serialised arguments compare equal."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return raw
    return json.dumps(raw, sort_keys=True, ensure_ascii=False)


def normal_message(m, i: int) -> dict:
    """One message as the endpoint compares and renders it: role, text content, tool calls (name and canonical
    arguments, ids kept for the template), tool_call_id and name. Two forms of the same turn (content null or
    "", arguments with other spacing) come out equal."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise refused(where, f"must be an object, not {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise refused(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    out: dict = {"role": "system" if role == "developer" else role, "content": _text(m.get("content"), where)}
    calls = m.get("tool_calls") or []
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise refused(f"{where}.tool_calls", "only an assistant message carries a list of tool calls")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise refused(f"{where}.tool_calls[{j}]", "needs function.name and function.arguments")
            call = {"name": fn["name"], "arguments": _arguments(fn.get("arguments", "{}"))}
            out["tool_calls"].append({"id": c.get("id", ""), "type": "function", "function": call})
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def same_turn(a: dict, b: dict) -> bool:
    """Whether two normalised messages are the same turn (tool-call ids aside: a client may renumber them)."""

    def strip(m):
        calls = [c["function"] for c in m.get("tool_calls", [])]
        return {**m, "tool_calls": calls, "tool_call_id": None}

    return strip(a) == strip(b)


def _number(body: dict, key: str, kind=(int, float), prefix: str = ""):
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, kind)):
        raise refused(prefix + key, f"must be a number, not {type(v).__name__}")
    return v


# Checks both routes share (chat completions, and vLLM's token route with `prefix` "sampling_params."): the same
# field gets the same refusal on either.


def check_run_sampling(fields: dict, run: RunSampling, prefix: str = "") -> None:
    """temperature and top_p absent or the run's own."""
    for key, want in (("temperature", run.temperature), ("top_p", run.top_p)):
        v = _number(fields, key, prefix=prefix)
        if v is not None and abs(v - want) > 1e-6:
            raise refused(
                prefix + key,
                f"{v:g} is not this run's {want:g}: the answers train the policy, so their logprobs must be "
                f"those of the policy as it samples (rollout.{key}); leave it out or send {want:g}",
            )


def checked_max_tokens(v, param: str, run: RunSampling) -> int | None:
    if v is not None:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise refused(param, f"must be a positive integer, not {v!r}")
        if v > run.max_new_tokens:
            raise refused(param, f"{v} is above this run's rollout.max_new_tokens={run.max_new_tokens}")
    return v


def checked_stop(v, param: str) -> list[str]:
    stop = [v] if isinstance(v, str) else (v or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise refused(param, "must be a string or a list of up to 4 non-empty strings")
    return stop


def flag(fields: dict, key: str) -> bool:
    v = fields.get(key, False)
    if v is not None and not isinstance(v, bool):
        raise refused(key, f"must be true or false, not {v!r}")
    return bool(v)


def parse_request(body, run: RunSampling) -> ChatRequest:
    """The request's fields checked against what the run can honour; OpenAIError (400, naming the field) for
    anything it cannot: no field is silently changed."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise refused("messages", "must be a non-empty list")
    messages = [normal_message(m, i) for i, m in enumerate(msgs)]
    check_run_sampling(body, run)
    if (n := _number(body, "n", int)) not in (None, 1):
        raise refused("n", f"{n} answers per call are not served; ask once per answer (n=1)")
    if body.get("logit_bias"):
        raise refused("logit_bias", "would change the policy's distribution; leave it out")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key):
            raise refused(key, "would change the policy's distribution; leave it out or send 0")
    if body.get("seed") is not None:
        raise refused("seed", "cannot be honoured: the engine's sampling is seeded per generator; leave it out")
    if _number(body, "top_logprobs", int):
        raise refused("top_logprobs", "is not served; `logprobs: true` returns each sampled token's logprob")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise refused("response_format", "only {'type': 'text'} is served (no constrained decoding)")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise refused("tool_choice", f"{choice!r} cannot be forced; send 'auto' or 'none'")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise refused("tools", "must be a list of tool objects")
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise refused(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
    for key, why in NOT_SERVED.items():
        if body.get(key) not in (None, [], {}):
            raise refused(key, why)
    if body.get("modalities") not in (None, ["text"]):
        raise refused("modalities", 'only ["text"] is served')
    if not isinstance(body.get("stream", False), bool):
        raise refused("stream", f"must be true or false, not {body['stream']!r}")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = checked_max_tokens(body.get(key), key, run)
    stop = checked_stop(body.get("stop"), "stop")
    opts = body.get("stream_options") or {}
    return_ids = flag(body, "return_token_ids")
    if return_ids and body.get("stream"):
        raise refused("return_token_ids", "is served on calls that are not streamed; send stream: false")
    return ChatRequest(
        messages=messages,
        tools=tools or None,
        tool_choice=choice,
        max_tokens=max_tokens,
        stop=stop,
        stream=bool(body.get("stream")),
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        logprobs=bool(body.get("logprobs")),
        model=str(body.get("model") or run.model_name),
        return_token_ids=return_ids,
    )


@dataclass
class Sampled:
    """One call's tokens as the engine saw and sampled them: the whole context it continued, and per sampled
    token its logprob and the weight version that sampled it."""

    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass
class Answer:
    """One call's outcome as the client will see it."""

    message: dict  # role assistant, content, tool_calls
    finish_reason: str  # stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[tuple[str, float]] | None = None  # (token text, logprob) when asked for
    sampled: Sampled | None = None  # when asked for (return_token_ids), and always on the token route


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(a: Answer) -> dict:
    return {
        "prompt_tokens": a.prompt_tokens,
        "completion_tokens": a.completion_tokens,
        "total_tokens": a.prompt_tokens + a.completion_tokens,
    }


def _logprobs(a: Answer) -> dict | None:
    if a.logprobs is None:
        return None
    tokens = [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in a.logprobs]
    return {"content": tokens}


def version_spans(versions: list[int]) -> list[dict]:
    """Per-token weight versions as vLLM's `weight_versions`: runs of one version, [start, end) over the output."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def completion(a: Answer, model: str) -> dict:
    """A chat.completion object; with the sampled tokens when the request asked (return_token_ids): vLLM's
    fields (prompt_token_ids, the choice's token_ids) and NeMo-Gym's on the message (prompt_token_ids,
    generation_token_ids, generation_log_probs), plus the per-token versions."""
    choice = {"index": 0, "message": a.message, "finish_reason": a.finish_reason, "logprobs": _logprobs(a)}
    out = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(a),
    }
    if a.sampled is not None:
        s = a.sampled
        choice["message"] = a.message | {
            "prompt_token_ids": s.prompt_ids,
            "generation_token_ids": s.ids,
            "generation_log_probs": s.logprobs,
        }
        choice |= {"token_ids": s.ids, "weight_versions": version_spans(s.versions)}
        out["prompt_token_ids"] = s.prompt_ids
    return out


def chunks(a: Answer, model: str, include_usage: bool) -> list[dict]:
    """The chat.completion.chunk objects of one answer, as a stream sends them: the role, the content, each tool
    call, the finish reason (and the usage when asked). The answer is whole before its first chunk: tokens
    are not streamed as they are sampled."""
    cid, created = new_id("chatcmpl"), int(time.time())

    def chunk(delta: dict, finish: str | None = None, **more) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None} | more
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}

    out = [chunk({"role": "assistant", "content": ""})]
    if a.message.get("content"):
        out.append(chunk({"content": a.message["content"]}, logprobs=_logprobs(a)))
    for i, call in enumerate(a.message.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append(chunk({}, a.finish_reason))
    if include_usage:
        out.append(chunk({}) | {"choices": [], "usage": usage(a)})
    return out


def models(model_name: str) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "areal-hpc"}]}
