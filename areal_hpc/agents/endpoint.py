"""A generator's OpenAI-compatible HTTP endpoint: an aiohttp server on a thread of its own, a key per episode."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from areal_hpc.agents.protocol import OpenAIError, RunSampling, chunks, completion, models, parse_request
from areal_hpc.agents.session import AgentSession
from areal_hpc.agents.transcript import ChatRenderer, ToolCallReader

log = logging.getLogger("areal_hpc.agents")


@dataclass
class EndpointSettings:
    run: RunSampling
    host: str = "127.0.0.1"  # loopback: reachable from this node only
    max_request_kb: int = 1024
    tool_parser: str = "hermes"
    max_context: int | None = None


class Endpoint:
    """Serves POST /v1/chat/completions and GET /v1/models to the holders of an open session's key, and nothing
    else: no route fetches a URL or reads a file. Requests are parsed and checked on the endpoint's thread;
    the call itself runs on the episode runner's loop (`call_in_loop` hands it over), so the HTTP handling
    never runs inside an engine step. Agents run on the endpoint's loop too (`submit`)."""

    LATENCIES_KEPT = 100_000

    def __init__(self, tokenizer, settings: EndpointSettings, call_in_loop: Callable):
        self.settings = settings
        self.call_in_loop = call_in_loop  # fn(*args) on the runner's loop, from any thread
        self.renderer = ChatRenderer(tokenizer)
        self.reader = ToolCallReader(settings.tool_parser, tokenizer)
        self.sessions: dict[str, AgentSession] = {}
        self.refused: collections.Counter = collections.Counter()  # by status code
        self.latencies_ms: collections.deque = collections.deque(maxlen=self.LATENCIES_KEPT)
        self.loop = asyncio.new_event_loop()
        self._ready = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, name="agent-endpoint", daemon=True)
        self._thread.start()
        self.port: int = self._ready.result(timeout=60)

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.host}:{self.port}/v1"

    # -- sessions (called on the runner's loop) ---------------------------------------------------------
    def open(self, ep) -> AgentSession:
        key = "sk-areal-" + secrets.token_urlsafe(32)
        s = AgentSession(ep, key, self.renderer, self.reader, self.settings.max_context)
        self.sessions[key] = s
        return s

    def close(self, session: AgentSession) -> None:
        self.sessions.pop(session.key, None)
        session.close()

    def submit(self, coro) -> concurrent.futures.Future:
        """Run a coroutine (an agent) on the endpoint's loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def shutdown(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    # -- HTTP (on the endpoint's thread) -----------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            from aiohttp import web

            app = web.Application(client_max_size=self.settings.max_request_kb * 1024, middlewares=[self._guard()])
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/chat/completions", self._chat)
            runner = web.AppRunner(app, access_log=None)
            self.loop.run_until_complete(runner.setup())
            # hundreds of agents connect at once when a batch of episodes starts: aiohttp's default backlog
            # (128) overflows and connections are reset (the kernel caps this at net.core.somaxconn)
            site = web.TCPSite(runner, self.settings.host, 0, backlog=4096)
            self.loop.run_until_complete(site.start())
            self._ready.set_result(site._server.sockets[0].getsockname()[1])
        except BaseException as e:
            self._ready.set_exception(e)
            return
        try:
            self.loop.run_forever()
        finally:
            left = asyncio.all_tasks(self.loop)  # agents still running: cancelled (a command's group is killed)
            for t in left:
                t.cancel()
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            self.loop.run_until_complete(runner.cleanup())
            self.loop.close()

    @staticmethod
    def _error(e: OpenAIError):
        from aiohttp import web

        return web.json_response(e.body(), status=e.status)

    def _session_of(self, request) -> AgentSession:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        session = self.sessions.get(key) if key else None
        if session is None or session.closed:
            what = "no API key was sent" if not key else "the API key is not an open episode's"
            raise OpenAIError(401, f"{what}: each episode's agent gets its own key", code="invalid_api_key")
        return session

    def _guard(self):
        """Every route needs an open session's key; every failure is an OpenAI-style error body."""
        from aiohttp import web

        @web.middleware
        async def guard(request, handler):
            try:
                request["session"] = self._session_of(request)
                return await handler(request)
            except OpenAIError as e:
                self.refused[e.status] += 1
                return self._error(e)
            except web.HTTPException as e:  # 404, 405, 413 from aiohttp itself
                self.refused[e.status] += 1
                return self._error(OpenAIError(e.status, e.reason))

        return guard

    async def _models(self, request):
        from aiohttp import web

        return web.json_response(models(self.settings.run.model_name))

    async def _chat(self, request):
        from aiohttp import web

        t0 = time.monotonic()
        session: AgentSession = request["session"]
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise OpenAIError(400, "the request body is not JSON") from None
        req = parse_request(body, self.settings.run)
        done: concurrent.futures.Future = concurrent.futures.Future()

        def submitted():
            self.latencies_ms.append((time.monotonic() - t0) * 1000)

        self.call_in_loop(self._start_call, session, req, submitted, done)
        answer = await asyncio.wrap_future(done)
        model = req.model
        if not req.stream:
            return web.json_response(completion(answer, model))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for c in chunks(answer, model, req.include_usage):
            await resp.write(f"data: {json.dumps(c)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _start_call(session: AgentSession, req, submitted, done: concurrent.futures.Future) -> None:
        """On the runner's loop: the call as a task, which hands its outcome to the waiting handler itself (a done
        callback alone would wait for another pass of the runner's loop, which nothing may ask for)."""
        ended = OpenAIError(401, "this episode has ended; its key is no longer valid", code="invalid_api_key")

        def settle(result=None, error: BaseException | None = None) -> None:
            if done.done():  # the handler gave up (the endpoint is shutting down)
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        if session.closed:
            settle(error=ended)
            return

        async def call():
            try:
                settle(await session.answer(req, submitted))
            except OpenAIError as e:
                settle(error=e)
            except Exception as e:  # a bug or a template that cannot render: the agent hears it, the log keeps it
                log.exception("agent call failed in episode %s", session.ep.key)
                settle(error=OpenAIError(500, f"{type(e).__name__}: {e}"))

        task = asyncio.get_running_loop().create_task(call())
        # closing the session cancels the task and answers its handler at once (a task cancelled before its
        # first step never runs its body, and its done callbacks wait for another pass of the runner's loop)
        session.tasks[task] = lambda: settle(error=ended)
        task.add_done_callback(lambda t: session.tasks.pop(t, None))
