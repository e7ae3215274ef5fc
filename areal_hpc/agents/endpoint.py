"""A generator's OpenAI-compatible endpoint: its process (HTTP and agents) started, and its calls answered here."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import multiprocessing
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from areal_hpc.agents import host, pipe
from areal_hpc.agents.protocol import OpenAIError, RunSampling
from areal_hpc.agents.running import ENDED, STOPPED, AgentOutcome
from areal_hpc.agents.session import AgentSession
from areal_hpc.agents.transcript import ChatRenderer, ToolCallReader
from areal_hpc.model import stop_token_ids

STOP_EXITS = {-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP}  # how a job's stop ends a process

log = logging.getLogger("areal_hpc.agents")


@dataclass
class EndpointSettings:
    run: RunSampling
    host: str = "127.0.0.1"  # loopback: reachable from this node only
    max_request_kb: int = 1024
    tool_parser: str = "hermes"
    max_context: int | None = None
    stop_ids: list[int] = field(default_factory=list)  # the tokens the engine ends an answer at
    vocab_size: int = 0  # the tokenizer's: a token-route id at or above it is refused

    @classmethod
    def of_run(cls, cfg, max_context: int | None, tokenizer) -> EndpointSettings:
        """The run's: it samples at rollout.temperature and top_p, and lists the model by its folder's name."""
        rc, wc = cfg.rollout, cfg.workflow
        run = RunSampling(rc.temperature, rc.top_p, rc.max_new_tokens, Path(cfg.model.path).name or "policy")
        stops = stop_token_ids(cfg.model.path, tokenizer)
        return cls(run, wc.endpoint_host, wc.max_request_kb, wc.tool_parser, max_context, stops, len(tokenizer))


class Endpoint:
    """The endpoint's process (agents/host.py: the HTTP server and the agents) and, here, the sessions that
    answer its calls. HTTP, request checks and the agents' own Python run in that process, so they never
    hold this process's GIL while an engine step runs; a checked call crosses the pipe and is answered on the
    episode runner's loop (`call_in_loop`), from the episode's exact transcript. Its settings are the run's
    (`cfg`, a Config), under the runner's bound on the model's context (`max_context`)."""

    LATENCIES_KEPT = 100_000
    START_S = 120  # the process imports aiohttp, openai and the user's agent before it answers

    def __init__(self, tokenizer, cfg, max_context: int | None, call_in_loop: Callable):
        self.settings = settings = EndpointSettings.of_run(cfg, max_context, tokenizer)
        workflow_cfg = cfg.workflow
        self.call_in_loop = call_in_loop  # fn(*args) on the runner's loop, from any thread
        self.renderer = ChatRenderer(tokenizer)
        self.reader = ToolCallReader(settings.tool_parser, tokenizer)
        self.sessions: dict[str, AgentSession] = {}
        self.agents: dict[str, concurrent.futures.Future] = {}  # key -> its agent's outcome, when it comes
        self.latencies_ms: collections.deque = collections.deque(maxlen=self.LATENCIES_KEPT)
        ctx = multiprocessing.get_context("spawn")  # nothing of this process's threads or torch state is copied
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=host.main, args=(child, settings, workflow_cfg), name="agent-endpoint", daemon=True
        )
        self.process.start()
        child.close()
        if not self.conn.poll(self.START_S):
            self.process.kill()
            raise RuntimeError(f"the agent endpoint's process did not start within {self.START_S} s")
        first = pipe.receive(self.conn, (pipe.Ready, pipe.Failed))
        if isinstance(first, pipe.Failed):
            raise RuntimeError(f"the agent endpoint could not start: {first.what}")
        self.port = first.port
        self._send_lock = threading.Lock()  # one message at a time on the pipe, whoever sends it
        self._reader = threading.Thread(target=self._read, name="agent-endpoint-pipe", daemon=True)
        self._reader.start()

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.host}:{self.port}/v1"

    def _send(self, msg) -> None:
        pipe.check(msg, pipe.TO_HOST)  # a bad message is this side's bug: it raises here
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, ValueError):  # the process is gone: its agents fail, their episodes see it
            pass

    # -- sessions (on the runner's loop) --------------------------------------------------------------------
    def open(self, ep) -> AgentSession:
        key = "sk-areal-" + secrets.token_urlsafe(32)
        s = AgentSession(ep, key, self.renderer, self.reader, self.settings.max_context)
        self.sessions[key] = s
        return s

    def start_agent(self, session: AgentSession, row: dict) -> concurrent.futures.Future:
        """The episode's agent starts in the endpoint's process; the future gets its AgentOutcome."""
        done = self.agents[session.key] = concurrent.futures.Future()
        self._send(pipe.StartAgent(session.key, dict(row)))
        if not self.process.is_alive():  # ended (a signal to it alone, a crash): no agent runs any more
            _settle(done, AgentOutcome(failure=self._how_it_ended(), kind=ENDED))
        return done

    def close(self, session: AgentSession) -> None:
        self.sessions.pop(session.key, None)
        self.agents.pop(session.key, None)
        session.close()
        self._send(pipe.CloseSession(session.key))

    def shutdown(self) -> None:
        self._send(pipe.Quit())
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        self.conn.close()

    # -- the pipe ----------------------------------------------------------------------------------------
    def _read(self) -> None:
        """On a thread of its own: the process's messages, handed over as they come (recv waits without the GIL)."""
        bad = None
        while True:
            try:
                msg = pipe.receive(self.conn, (pipe.ChatCall, pipe.TokenCall, pipe.AgentDone))
            except (EOFError, OSError):
                break
            except pipe.PipeError as e:  # a bug on the process's side: the endpoint is lost, in one line
                bad = str(e)
                break
            if isinstance(msg, (pipe.ChatCall, pipe.TokenCall)):
                self.call_in_loop(self._start_call, msg)
            else:
                fut = self.agents.get(msg.key)
                if fut is not None:
                    _settle(fut, msg.outcome)
        # the process ended: no agent will report. Ended by a stop signal, the job is stopping (the signal reached
        # this rank's process group): a by-product, not a cause, and the episodes in flight go quietly
        how = bad or self._how_it_ended()
        stopping = bad is None and self.process.exitcode in STOP_EXITS
        for fut in list(self.agents.values()):
            _settle(fut, AgentOutcome(failure=how, kind=STOPPED if stopping else ENDED))

    def _how_it_ended(self) -> str:
        """The endpoint's process's end, in words (waited for briefly: the pipe closes just before it exits)."""
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        if code is None:
            return "the agent endpoint's process closed its pipe"
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        return f"the agent endpoint's process {how} (its log is this rank's)"

    def _start_call(self, msg: pipe.ChatCall | pipe.TokenCall) -> None:
        """On the runner's loop: the call as a task on its session, which sends the outcome back itself (a done
        callback alone would wait for another pass of the runner's loop, which nothing may ask for)."""
        ended = OpenAIError(401, "this episode has ended; its key is no longer valid", code="invalid_api_key")
        told = False

        def tell(reply) -> None:
            nonlocal told
            if not told:
                self._send(reply)  # a bad reply raises before it counts as told: the 500 below goes instead
                told = True

        session = self.sessions.get(msg.key)
        if session is None or session.closed:
            tell(pipe.CallRefused(msg.call, ended))
            return

        def submitted():
            self.latencies_ms.append((time.monotonic() - msg.t_received) * 1000)

        answer_on = session.answer if isinstance(msg, pipe.ChatCall) else session.answer_tokens

        async def answer():
            try:
                tell(pipe.CallAnswered(msg.call, await answer_on(msg.request, submitted)))
            except OpenAIError as e:
                tell(pipe.CallRefused(msg.call, e))
            except Exception as e:  # a bug or a template that cannot render: the agent hears it, the log keeps it
                log.exception("agent call failed in episode %s", session.ep.key)
                tell(pipe.CallRefused(msg.call, OpenAIError(500, f"{type(e).__name__}: {e}")))

        task = asyncio.get_running_loop().create_task(answer())
        # closing the session cancels the task and answers its caller at once (a task cancelled before its
        # first step never runs its body, and its done callbacks wait for another pass of the runner's loop)
        session.tasks[task] = lambda: tell(pipe.CallRefused(msg.call, ended))
        task.add_done_callback(lambda t: session.tasks.pop(t, None))


def _settle(fut: concurrent.futures.Future, outcome: AgentOutcome) -> None:
    """Its outcome, unless another thread gave it one first (the pipe's reader, as the process ended)."""
    try:
        fut.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass
