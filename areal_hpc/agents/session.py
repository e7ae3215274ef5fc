"""One episode's session: each chat request becomes one generate call on the episode's exact token transcript."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from areal_hpc.agents.protocol import Answer, ChatRequest, OpenAIError, Sampled, normal_message, same_turn
from areal_hpc.agents.token_route import TokenRequest
from areal_hpc.agents.transcript import ChatRenderer, ToolCallReader, template_messages


class AgentSession:
    """The conversation an agent holds with the endpoint under one key, on top of its episode (`ep`: an
    areal_hpc.workflow Episode). The transcript is the episode's: a request that extends the history gets
    only its new messages rendered and appended (not trained); earlier assistant turns are recognised as the
    answers this session returned, and their sampled tokens stay as they were. A request that does not
    extend the history starts a branch (`ep.branch`): the transcript so far is kept as a sample of its own.
    A token-route request (ids the harness rendered itself) extends the transcript when the transcript is a
    prefix of its ids, and starts a branch otherwise. Runs on the episode runner's event loop."""

    def __init__(self, ep, key: str, renderer: ChatRenderer, reader: ToolCallReader, max_context: int | None):
        self.ep, self.key = ep, key
        self.renderer, self.reader = renderer, reader
        self.max_context = max_context
        self.history: list[dict] = []  # normalised messages so far; assistant turns as this session returned them
        self.last_sampled: list[int] = []  # the tokens of the last answer (what closes its turn depends on them)
        self.tools_key: str | None = None  # the tools the transcript was rendered with
        self.calls = 0
        self.branches = 0
        self.closed = False
        self._lock: asyncio.Lock | None = None  # one call at a time: a transcript grows in one line
        self.tasks: dict[asyncio.Task, Callable[[], None]] = {}  # calls in flight -> how to tell their handler

    def _context(self, req: ChatRequest, tools_key: str) -> tuple[str, list[int]]:
        """("extend", the tokens to append) or ("branch", a whole new context)."""
        msgs, h = req.messages, self.history
        extends = (
            h
            and len(msgs) > len(h)
            and tools_key == self.tools_key
            and all(same_turn(a, b) for a, b in zip(h, msgs))
            and msgs[len(h)]["role"] != "assistant"
        )
        if extends:
            new = template_messages(msgs[len(h) :])
            closing = self.renderer.rest_of_turn_end(self.last_sampled)
            return "extend", closing + self.renderer.extension(new, req.tools, tools_key)
        return "branch", self.renderer.prompt(template_messages(msgs), req.tools)

    def _check_length(self, n_prompt: int, req: ChatRequest) -> None:
        limit = self.max_context
        if limit is None:
            return
        asked = req.max_tokens or 1
        if n_prompt + asked > limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + asked} tokens ({n_prompt} in the messages, {asked} in the completion). "
                "Please reduce the length of the messages or completion.",
                "messages",
                "context_length_exceeded",
            )

    @contextlib.asynccontextmanager
    async def _turn(self):
        """One call at a time, on an open episode."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.closed:
                raise OpenAIError(401, "this episode has ended; its key is no longer valid", code="invalid_api_key")
            yield

    async def _generate(self, kind: str, ids: list[int], req, on_submit):
        """The transcript extended by `ids` or branched to them, then one generate call: (its output, the
        context the engine continued)."""
        n_prompt = len(ids) + (len(self.ep.tokens) if kind == "extend" else 0)
        self._check_length(n_prompt, req)
        if kind == "extend":
            self.ep.append_tokens(ids)
        else:
            self.branches += self.calls > 0  # the first call starts the transcript: not a branch
            self.ep.branch(ids)
        self.calls += 1
        context = self.ep.tokens
        if on_submit is not None:
            on_submit()
        out = await self.ep.generate(max_new_tokens=req.max_tokens, stop=req.stop or None)
        self.last_sampled = list(out.ids)
        return out, context

    async def answer_tokens(self, req: TokenRequest, on_submit=None) -> Answer:
        """One token-route call: the harness's ids extend the transcript (or branch it), one generate call."""
        async with self._turn():
            have = self.ep.tokens
            if req.token_ids[: len(have)] == have:
                kind, ids = "extend", req.token_ids[len(have) :]
            else:
                kind, ids = "branch", req.token_ids
            out, context = await self._generate(kind, ids, req, on_submit)
            self.history = []  # the chat history no longer describes the transcript: a chat call branches
            message = {"role": "assistant", "content": out.text}
            return Answer(message, out.finish_reason, len(context), len(out.ids), sampled=_sampled(context, out))

    async def answer(self, req: ChatRequest, on_submit=None) -> Answer:
        """One call: the context updated, one generate call, the answer read for tool calls. `on_submit()` runs
        as the request goes to the engine (the endpoint's latency figure)."""
        async with self._turn():
            tools_key = repr(req.tools)
            kind, ids = self._context(req, tools_key)
            self.tools_key = tools_key
            out, context = await self._generate(kind, ids, req, on_submit)
            self.history = list(req.messages)  # the transcript has them now, whatever reading the answer does
            text = out.text
            for s in req.stop:  # the API leaves a stop sequence out of the content (the transcript keeps it)
                if text.endswith(s):
                    text = text[: -len(s)]
                    break
            tools = req.tools if req.tool_choice != "none" else None
            content, calls = self.reader.read(text, tools, tools_key)
            message: dict = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
                self.ep.stats.tool_calls += len(calls)  # the agent runs them; the episode counts them
            finish = "tool_calls" if calls else out.finish_reason
            self.history.append(normal_message(message, len(req.messages)))
            lps = None
            if req.logprobs:
                toks = self.ep.tokenizer.convert_ids_to_tokens(list(out.ids))
                lps = list(zip(toks, (float(x) for x in out.logprobs)))
            sampled = _sampled(context, out) if req.return_token_ids else None
            return Answer(message, finish, len(context), len(out.ids), lps, sampled)

    def close(self) -> None:
        """The episode ended: calls still in flight are cancelled and their handlers answered (401) now."""
        self.closed = True
        for task, tell in list(self.tasks.items()):
            task.cancel()
            tell()


def _sampled(context: list[int], out) -> Sampled:
    return Sampled(context, list(out.ids), [float(x) for x in out.logprobs], list(out.versions))
