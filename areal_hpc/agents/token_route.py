"""vLLM's token route (POST /inference/v1/generate): token ids and sampling settings checked into a typed record,
and the reply with the sampled ids, their logprobs and versions, for harnesses that render their own prompts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from areal_hpc.agents.protocol import (
    Answer,
    OpenAIError,
    RunSampling,
    check_run_sampling,
    checked_max_tokens,
    checked_stop,
    flag,
    new_id,
    refused,
    usage,
    version_spans,
)

PATH = "/inference/v1/generate"  # at the server's root, as vLLM mounts it (not under /v1)

# sampling settings that change only how the output is written out: the sampled tokens are the same
FORMAT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "detokenize", "include_stop_str_in_output"}
# settings that would change what the policy samples, each with the one value it may repeat
AS_SAMPLED = {
    "n": 1,
    "top_k": (0, -1),
    "min_p": 0,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "ignore_eos": False,
}
NOT_SERVED = ("prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words", "structured_outputs")
# the body fields of vLLM's request: read, refused when set, or of no use here (they change nothing sampled)
BODY = {"token_ids", "sampling_params", "return_token_ids", "request_id", "model", "stream", "output_mode"}
BODY |= {"priority", "features", "content_parts", "kv_transfer_params", "ec_transfer_params"}
BODY |= {"cache_salt", "stream_options", "reasoning_ended", "reasoning_parser_kwargs"}


@dataclass
class TokenRequest:
    """A checked token-route request: the context as ids and what bounds the answer."""

    token_ids: list[int]
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    model: str = ""
    return_token_ids: bool = False  # the context's ids in the reply (prompt_token_ids)


def _sp_refused(key: str, message: str) -> OpenAIError:
    return refused(f"sampling_params.{key}", message)


def _id_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _same(v, allowed) -> bool:
    """Whether `v` is one of the `allowed` values; a bool is no number here (True == 1), only itself."""
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    return any((v == a and type(v) is not bool) or v is a for a in allowed)


def parse_generate(body, run: RunSampling, stop_ids: list[int], vocab_size: int) -> TokenRequest:
    """vLLM's generate request checked against what the run can honour (`stop_ids`: the tokens the engine ends
    an answer at; ids below `vocab_size`); OpenAIError (400, naming the field) for anything it cannot, as chat
    completions refuse: a bad request never reaches the engine."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    ids = body.get("token_ids")
    if not _id_list(ids) or not ids:
        raise refused("token_ids", "must be a non-empty list of token ids")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise refused("token_ids", f"{bad} is not a token id of this model (0 to {vocab_size - 1})")
    for key in ("features", "content_parts"):
        if body.get(key):
            raise refused(key, "multimodal input is not served: send text token ids")
    for key in ("kv_transfer_params", "ec_transfer_params"):
        if body.get(key):
            raise refused(key, "disaggregated serving is not served here")
    if body.get("stream"):
        raise refused("stream", "is not served on this route: the reply comes whole (send stream: false)")
    if body.get("output_mode", "tokens") != "tokens":
        raise refused("output_mode", f"{body['output_mode']!r} is not served: only 'tokens'")
    if body.get("priority", 0) != 0:
        raise refused("priority", "is not served: requests are served as they come (send 0)")
    unknown = set(body) - BODY
    if unknown:
        raise refused(sorted(unknown)[0], "is not a field of vLLM's generate request this endpoint serves")
    return_ids = flag(body, "return_token_ids")
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise refused("sampling_params", "must be an object of vLLM's sampling settings")
    _check_sampling(sp, run, stop_ids)
    return TokenRequest(
        token_ids=list(ids),
        max_tokens=checked_max_tokens(sp.get("max_tokens"), "sampling_params.max_tokens", run),
        stop=checked_stop(sp.get("stop"), "sampling_params.stop"),
        request_id=str(body.get("request_id") or new_id("gen")),
        model=str(body.get("model") or run.model_name),
        return_token_ids=return_ids,
    )


def _check_sampling(sp: dict, run: RunSampling, stop_ids: list[int]) -> None:
    check_run_sampling(sp, run, "sampling_params.")
    for key, allowed in AS_SAMPLED.items():
        v = sp.get(key)
        if v is not None and not _same(v, allowed):
            one = allowed[0] if isinstance(allowed, tuple) else allowed
            raise _sp_refused(key, f"{v!r} would change how the policy samples; leave it out or send {one!r}")
    if sp.get("seed") is not None:
        raise _sp_refused("seed", "cannot be honoured: the engine's sampling is seeded per generator; leave it out")
    lp = sp.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or lp not in (0, 1)):
        raise _sp_refused("logprobs", f"{lp!r} top logprobs are not served; 0 or 1 returns each sampled token's")
    for key in NOT_SERVED:
        if sp.get(key) not in (None, [], {}):
            raise _sp_refused(key, "would change the policy's distribution or is not served; leave it out")
    known = {"temperature", "top_p", "seed", "logprobs", "max_tokens", "stop", "stop_token_ids", *AS_SAMPLED}
    unknown = set(sp) - known - set(NOT_SERVED) - FORMAT_ONLY
    if unknown:
        raise _sp_refused(sorted(unknown)[0], "is not a sampling setting this endpoint serves")
    ids = sp.get("stop_token_ids") or []
    if not _id_list(ids):
        raise _sp_refused("stop_token_ids", f"must be a list of token ids, not {ids!r}")
    extra = sorted(set(ids) - set(stop_ids))
    if extra:
        raise _sp_refused(
            "stop_token_ids",
            f"{extra} are not tokens the engine ends an answer at; it ends at {sorted(stop_ids)} (send a subset)",
        )


def generate_reply(a: Answer, req: TokenRequest) -> dict:
    """vLLM's GenerateTokensResponse: the sampled ids with their logprobs (each entry names its id both as vLLM's
    `token_id` and as the `token_id:N` text that token-id clients read) and per-token versions."""
    s = a.sampled
    content = [
        {"token_id": t, "token": f"token_id:{t}", "logprob": lp, "top_logprobs": []} for t, lp in zip(s.ids, s.logprobs)
    ]
    choice = {
        "index": 0,
        "finish_reason": a.finish_reason,
        "stop_reason": None,
        "token_ids": s.ids,
        "logprobs": {"content": content},
        "weight_versions": version_spans(s.versions),
    }
    out = {
        "request_id": req.request_id,
        "model": req.model,
        "created": int(time.time()),
        "output_mode": "tokens",
        "choices": [choice],
        "usage": usage(a),
    }
    if req.return_token_ids:
        out["prompt_token_ids"] = s.prompt_ids
    return out
