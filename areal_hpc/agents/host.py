"""The endpoint's own process: the HTTP server and the agents, off the generator's GIL; calls cross a pipe."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time

from areal_hpc.agents import pipe
from areal_hpc.agents.protocol import OpenAIError, chunks, completion, models, parse_request
from areal_hpc.agents.running import AgentOutcome, AgentRunner
from areal_hpc.agents.token_route import PATH as TOKEN_PATH
from areal_hpc.agents.token_route import generate_reply, parse_generate

log = logging.getLogger("areal_hpc.agents")
# the pipe's messages to and from the generator: agents/pipe.py


def main(conn, settings, wc) -> None:
    """The process's entry (spawned by the generator, killed with it)."""
    from areal_hpc.rundir.lifetime import die_with_parent

    die_with_parent()
    try:
        asyncio.run(Host(conn, settings, wc).serve())
    except KeyboardInterrupt:
        pass


class Host:
    """Serves POST /v1/chat/completions, GET /v1/models and vLLM's token route (POST /inference/v1/generate) to
    the holders of an open episode's key, and nothing else: no route fetches a URL or reads a file. Each checked
    call goes to the generator, whose session of that episode answers it from the engine. Runs the episodes'
    agents on the same loop."""

    def __init__(self, conn, settings, wc):
        self.conn, self.settings, self.wc = conn, settings, wc
        self.keys: set[str] = set()  # the open episodes' keys
        self.agents: dict[str, asyncio.Task] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.stopped: asyncio.Event | None = None
        self.bad_message: pipe.PipeError | None = None  # the generator sent what the protocol does not carry

    async def serve(self) -> None:
        from aiohttp import web

        loop = asyncio.get_running_loop()
        self.stopped = asyncio.Event()
        try:
            app = web.Application(client_max_size=self.settings.max_request_kb * 1024, middlewares=[self._guard()])
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_post(TOKEN_PATH, self._tokens)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            # hundreds of agents connect at once when a batch of episodes starts: aiohttp's default backlog
            # (128) overflows and connections are reset (the kernel caps this at net.core.somaxconn)
            site = web.TCPSite(runner, self.settings.host, 0, backlog=4096)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.agent_runner = AgentRunner(f"http://{self.settings.host}:{port}/v1", self.wc)
        except BaseException as e:
            self._send(pipe.Failed(f"{type(e).__name__}: {e}"))
            return
        loop.add_reader(self.conn.fileno(), self._read)
        self._send(pipe.Ready(port))
        try:
            await self.stopped.wait()
        finally:
            loop.remove_reader(self.conn.fileno())
            for t in self.agents.values():
                t.cancel()
            await asyncio.gather(*self.agents.values(), return_exceptions=True)
            await self.agent_runner.close()
            await runner.cleanup()
        if self.bad_message is not None:  # a bug on the generator's side: this process ends and it sees how
            raise self.bad_message

    def _send(self, msg) -> None:
        pipe.send(self.conn, msg, pipe.TO_GENERATOR)

    # -- the generator's messages ------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while self.conn.poll():
                self._on(pipe.receive(self.conn, pipe.TO_HOST))
        except (EOFError, OSError):  # the generator is gone
            self.stopped.set()
        except pipe.PipeError as e:
            self.bad_message = e
            self.stopped.set()

    def _on(self, msg) -> None:
        if isinstance(msg, pipe.StartAgent):
            self.keys.add(msg.key)
            self.agents[msg.key] = asyncio.get_running_loop().create_task(self._agent(msg.key, msg.row))
        elif isinstance(msg, pipe.CloseSession):
            self.keys.discard(msg.key)
            task = self.agents.pop(msg.key, None)
            if task is not None and not task.done():
                task.cancel()
        elif isinstance(msg, (pipe.CallAnswered, pipe.CallRefused)):
            fut = self.calls.pop(msg.call, None)
            if fut is not None and not fut.done():
                if isinstance(msg, pipe.CallAnswered):
                    fut.set_result(msg.answer)
                else:
                    fut.set_exception(msg.error)
        elif isinstance(msg, pipe.Quit):
            self.stopped.set()

    async def _agent(self, key: str, row: dict) -> None:
        try:
            outcome = await self.agent_runner.run(key, row)
        except asyncio.CancelledError:
            return  # its episode ended first (a stop, an evaluation cut): nobody waits for it
        except BaseException as e:  # noqa: BLE001 (the runner catches the agent's own; this is a bug's)
            outcome = AgentOutcome(failure=f"it could not run: {type(e).__name__}: {e}")
        self.agents.pop(key, None)
        self._send(pipe.AgentDone(key, outcome))

    # -- HTTP --------------------------------------------------------------------------------------------
    def _guard(self):
        """Every route needs an open episode's key; every failure is an OpenAI-style error body."""
        from aiohttp import web

        @web.middleware
        async def guard(request, handler):
            try:
                auth = request.headers.get("Authorization", "")
                key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
                if key not in self.keys:
                    what = "no API key was sent" if not key else "the API key is not an open episode's"
                    raise OpenAIError(401, f"{what}: each episode's agent gets its own key", code="invalid_api_key")
                request["key"] = key
                return await handler(request)
            except OpenAIError as e:
                return web.json_response(e.body(), status=e.status)
            except web.HTTPException as e:  # 404, 405, 413 from aiohttp itself
                return web.json_response(OpenAIError(e.status, e.reason).body(), status=e.status)

        return guard

    async def _models(self, request):
        from aiohttp import web

        return web.json_response(models(self.settings.run.model_name))

    async def _body(self, request):
        try:
            return await request.json()
        except (ValueError, UnicodeDecodeError):
            raise OpenAIError(400, "the request body is not JSON") from None

    async def _ask(self, record, key: str, req, t0: float):
        """The checked request across the pipe to the episode's session; its answer (or its refusal, raised)."""
        call = next(self.ids)
        fut = self.calls[call] = asyncio.get_running_loop().create_future()
        self._send(record(call, key, req, t0))
        try:
            return await fut
        finally:
            self.calls.pop(call, None)

    async def _tokens(self, request):
        from aiohttp import web

        t0 = time.monotonic()
        settings = self.settings
        req = parse_generate(await self._body(request), settings.run, settings.stop_ids, settings.vocab_size)
        answer = await self._ask(pipe.TokenCall, request["key"], req, t0)
        return web.json_response(generate_reply(answer, req))

    async def _chat(self, request):
        from aiohttp import web

        t0 = time.monotonic()  # the system's monotonic clock: the generator reads the same one
        req = parse_request(await self._body(request), self.settings.run)
        answer = await self._ask(pipe.ChatCall, request["key"], req, t0)
        if not req.stream:
            return web.json_response(completion(answer, req.model))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for c in chunks(answer, req.model, req.include_usage):
            await resp.write(f"data: {json.dumps(c)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
