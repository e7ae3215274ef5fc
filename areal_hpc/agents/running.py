"""One episode's agent, run within its time limit: a function in the endpoint's process, or a command of its own."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import signal
from dataclasses import dataclass

from areal_hpc.plugins import check_signature, resolve, user_frame

ENDED, STOPPED = "ended", "stopped"  # AgentOutcome.kind when the endpoint's process ended: a crash, or a stop


class AgentFailed(Exception):
    """A command agent that exited non-zero or printed no result: its message says what it did."""

    def __init__(self, what: str, kind: str):
        super().__init__(what)
        self.kind = kind


@dataclass
class AgentOutcome:
    value: object = None  # a float (the reward), a str (the final answer) or None (rejected)
    failure: str = ""  # why the agent failed ("RuntimeError: x", "it exited with status 1: ..."): its episode is lost
    # of the failure: raised | timed out | bad result (workflow.records.FAILURE_KINDS); ENDED or STOPPED when the
    # endpoint's process ended under it (not the agent's failure)
    kind: str = ""
    where: str = ""  # the agent's file:line that raised, when it was a function


def load_agent(wc):
    """workflow.agent's function, checked as `async def fn(client, row)`; PluginError (one line) if unusable."""
    fn = resolve(wc.agent, "workflow.agent")
    check_signature(fn, wc.agent, "workflow.agent", ("client", "row"), is_async=True)
    return fn


class AgentRunner:
    """Runs one episode's agent on the endpoint process's loop: in that process (`workflow.agent`) with an
    AsyncOpenAI client on the episode's key, or as a command (`workflow.agent_command`) with OPENAI_BASE_URL and
    OPENAI_API_KEY in its environment. Both within workflow.agent_timeout_s."""

    def __init__(self, base_url: str, wc):
        self.base_url, self.wc = base_url, wc
        self.fn = load_agent(wc) if wc.agent else None
        self._http = None  # one connection pool for every in-process agent's client

    async def run(self, key: str, row: dict) -> AgentOutcome:
        try:
            if self.fn is not None:
                value = await asyncio.wait_for(self._in_process(key, row), self.wc.agent_timeout_s)
            else:
                value = await self._command(key, row)
        except TimeoutError:
            what = f"it ran past workflow.agent_timeout_s={self.wc.agent_timeout_s:g} s"
            return AgentOutcome(failure=what, kind="timed out")
        except AgentFailed as e:
            return AgentOutcome(failure=str(e), kind=e.kind)
        except BaseException as e:  # SystemExit and an agent's own CancelledError too: the endpoint's loop goes on
            if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # the episode was cancelled (a stop, an evaluation cut)
            return AgentOutcome(failure=f"{type(e).__name__}: {e}", kind="raised", where=user_frame(e))
        return _checked(value)

    async def _in_process(self, key: str, row: dict):
        import httpx
        import openai

        if self._http is None:  # every episode's connection kept alive (the client's default keeps 100)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=4096)
            self._http = openai.DefaultAsyncHttpxClient(limits=limits)
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, http_client=self._http)
        return await self.fn(client, dict(row))

    async def _command(self, key: str, row: dict):
        env = dict(os.environ, OPENAI_BASE_URL=self.base_url, OPENAI_API_KEY=key)
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
            raise AgentFailed(f"it exited with status {proc.returncode}: {tail[0][:300]}", "raised")
        lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
        last = lines[-1] if lines else ""
        try:
            result = json.loads(last)
        except ValueError:
            result = None
        if not isinstance(result, dict) or not ({"reward", "answer"} & set(result)):
            what = f'it printed {last[:200]!r} last, not {{"reward": x}} or {{"answer": "..."}}'
            raise AgentFailed(what, "bad result")
        if "reward" in result:
            reward = result["reward"]
            if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
                what = f'it printed a "reward" that is a {type(reward).__name__}, not a number or null'
                raise AgentFailed(what, "bad result")
            return reward
        return _answer(result["answer"])

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()


def _answer(value):
    if not isinstance(value, str):
        raise AgentFailed(f'it printed an "answer" that is a {type(value).__name__}, not a string', "bad result")
    return value


def _checked(value) -> AgentOutcome:
    """A float is the reward, a string the final answer, None a rejection; anything else is a failure."""
    if value is None or isinstance(value, str):
        return AgentOutcome(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return AgentOutcome(float(value))
    what = f"it returned {value!r} ({type(value).__name__}); return a float, a str or None"
    return AgentOutcome(failure=what, kind="bad result")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
