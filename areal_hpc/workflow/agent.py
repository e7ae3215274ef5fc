"""The `agent` workflow: an agent written against the OpenAI API runs once per episode on this generator's endpoint."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shlex
import shutil
import signal
from dataclasses import dataclass

from areal_hpc.agents.endpoint import Endpoint, EndpointSettings
from areal_hpc.agents.protocol import RunSampling
from areal_hpc.agents.transcript import tool_parser_class
from areal_hpc.plugins import check_signature, resolve

log = logging.getLogger("areal_hpc.workflow")


class AgentFailed(Exception):
    """A command agent that exited non-zero or printed no result: its message starts "it <kind> ..."."""


@dataclass
class AgentOutcome:
    value: object = None  # a float (the reward), a str (the final answer) or None (rejected)
    failure: str = ""  # why the agent failed: its episode is lost, not scored


def load_agent(wc):
    """workflow.agent's function, checked as `async def fn(client, row)`; PluginError (one line) if unusable."""
    fn = resolve(wc.agent, "workflow.agent")
    check_signature(fn, wc.agent, "workflow.agent", ("client", "row"), is_async=True)
    return fn


def check_agent_config(wc) -> None:
    """The start-up check (config_checks has checked the settings' form): the agent imports and has the
    signature, or the command's program exists; the tool parser exists. One line (ValueError) if not."""
    if wc.agent:
        load_agent(wc)
    else:
        try:
            argv = shlex.split(wc.agent_command)
        except ValueError as e:
            raise ValueError(f"workflow.agent_command={wc.agent_command!r} does not split into words: {e}") from None
        if not argv or shutil.which(argv[0]) is None:
            raise ValueError(
                f"workflow.agent_command={wc.agent_command!r}: {argv[0] if argv else 'nothing'!r} is not a program "
                "found on PATH (or an executable file)"
            )
    if wc.tool_parser != "none":
        tool_parser_class(wc.tool_parser)


class AgentRunner:
    """Runs one episode's agent on the endpoint's loop: in this process (`workflow.agent`) with an AsyncOpenAI
    client on the episode's key, or as a command (`workflow.agent_command`) with OPENAI_BASE_URL and
    OPENAI_API_KEY in its environment. Both within workflow.agent_timeout_s."""

    def __init__(self, endpoint: Endpoint, wc):
        self.endpoint, self.wc = endpoint, wc
        self.fn = load_agent(wc) if wc.agent else None
        self._http = None  # one connection pool for every in-process agent's client

    async def run(self, key: str, row: dict) -> AgentOutcome:
        try:
            if self.fn is not None:
                value = await asyncio.wait_for(self._in_process(key, row), self.wc.agent_timeout_s)
            else:
                value = await self._command(key, row)
        except TimeoutError:
            return AgentOutcome(failure=f"it ran past workflow.agent_timeout_s={self.wc.agent_timeout_s:g} s")
        except AgentFailed as e:
            return AgentOutcome(failure=str(e))
        except BaseException as e:  # SystemExit and an agent's own CancelledError too: the endpoint's loop goes on
            if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # the episode was cancelled (a stop, an evaluation cut)
            return AgentOutcome(failure=f"it raised {type(e).__name__}: {e}")
        return _checked(value)

    async def _in_process(self, key: str, row: dict):
        import httpx
        import openai

        if self._http is None:  # every episode's connection kept alive (the client's default keeps 100)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=4096)
            self._http = openai.DefaultAsyncHttpxClient(limits=limits)
        client = openai.AsyncOpenAI(base_url=self.endpoint.base_url, api_key=key, max_retries=0, http_client=self._http)
        return await self.fn(client, dict(row))

    async def _command(self, key: str, row: dict):
        env = dict(os.environ, OPENAI_BASE_URL=self.endpoint.base_url, OPENAI_API_KEY=key)
        proc = await asyncio.create_subprocess_exec(
            *shlex.split(self.wc.agent_command),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: a time-out kills whatever it started too
        )
        data = json.dumps(row, default=str).encode()
        try:
            out, err = await asyncio.wait_for(proc.communicate(data), self.wc.agent_timeout_s)
        finally:  # at its time limit, a cancellation, or after it exited: whatever it started goes with it
            _kill_group(proc.pid)
            if proc.returncode is None:
                await proc.wait()
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output on stderr"]
            raise AgentFailed(f"it exited with status {proc.returncode}: {tail[0][:300]}")
        lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
        last = lines[-1] if lines else ""
        try:
            result = json.loads(last)
        except ValueError:
            result = None
        if not isinstance(result, dict) or not ({"reward", "answer"} & set(result)):
            raise AgentFailed(f'it printed {last[:200]!r} last, not {{"reward": x}} or {{"answer": "..."}}')
        if "reward" in result:
            reward = result["reward"]
            if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
                raise AgentFailed(f'it printed a "reward" that is a {type(reward).__name__}, not a number or null')
            return reward
        return _answer(result["answer"])

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()


def _answer(value):
    if not isinstance(value, str):
        raise AgentFailed(f'it printed an "answer" that is a {type(value).__name__}, not a string')
    return value


def _checked(value) -> AgentOutcome:
    """A float is the reward, a string the final answer, None a rejection; anything else is a failure."""
    if value is None or isinstance(value, str):
        return AgentOutcome(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return AgentOutcome(float(value))
    return AgentOutcome(failure=f"it returned {value!r} ({type(value).__name__}); return a float, a str or None")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class AgentEndpoint:
    """The runner's endpoint and agent runner together (one per episode runner, closed with it)."""

    def __init__(self, runner, wc):
        s = runner.settings
        sampling = RunSampling(s.temperature, s.top_p, s.max_new_tokens, s.model_name)
        settings = EndpointSettings(sampling, wc.endpoint_host, wc.max_request_kb, wc.tool_parser, s.max_context)
        self.endpoint = Endpoint(runner.tokenizer, settings, runner.call_in_loop)
        self.agents = AgentRunner(self.endpoint, wc)
        self.failures_logged: set[str] = set()
        # The openai client's HTTP layer logs every request at INFO, and vLLM's parsers log a traceback for every
        # answer that does not parse (returned as content, as meant): tens of thousands of lines a run otherwise.
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)
        log.info("agent endpoint at %s", self.endpoint.base_url)

    def close(self) -> None:
        try:
            self.endpoint.submit(self.agents.close()).result(timeout=10)
        except Exception:
            pass
        self.endpoint.shutdown()


async def agent(ep) -> float | None:
    """rollout.workflow=agent: the episode's session is opened, the agent runs against it, and its result
    becomes the episode's reward: a float as it is, a string scored by reward.fn with the row, None rejects
    the episode. An agent that fails (raises, hangs past workflow.agent_timeout_s, returns or prints something
    else) costs its episode only: counted (agent_failures), the first failure of each kind logged once, and
    the episode run again."""
    runner = ep._runner  # noqa: SLF001 (a built-in workflow: the endpoint lives as long as the runner)
    shared: AgentEndpoint = runner.shared("agent-endpoint", lambda: AgentEndpoint(runner, ep.config))
    session = shared.endpoint.open(ep)
    try:
        outcome: AgentOutcome = await runner.wait(shared.endpoint.submit(shared.agents.run(session.key, ep.row)))
    except RuntimeError as e:  # the endpoint's loop ended under it
        outcome = AgentOutcome(failure=f"it stopped: {e}")
    finally:
        shared.endpoint.close(session)
    ep.stats.branches += session.branches
    if outcome.failure:
        ep.stats.agent_failures += 1
        kind = outcome.failure.split(" ", 2)[1]  # raised / ran / returned / exited / printed
        if kind not in shared.failures_logged:
            shared.failures_logged.add(kind)
            log.warning(
                "an agent failed in episode %s: %s (its episode runs again; logged once)", ep.key, outcome.failure
            )
        return None
    if isinstance(outcome.value, str):
        return await ep.reward(outcome.value)
    return outcome.value
