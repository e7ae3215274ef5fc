"""Runs many episodes at once as asyncio tasks over a step-driven engine, stepped by the generator's own loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

from areal_hpc.plugins import user_frame
from areal_hpc.types import GenOutput, GenRequest, RequestId
from areal_hpc.workflow.calls import EngineRequests, RewardBatches, ToolThreads
from areal_hpc.workflow.episode import Episode
from areal_hpc.workflow.failures import (
    CANCELLED,
    SCORED,
    VOID,
    EndpointLost,
    EpisodeFailed,
    FailureBudget,
    TooManyFailures,
)
from areal_hpc.workflow.records import EpisodeFailure, FinishedEpisode, ToolResult
from areal_hpc.workflow.stepped_loop import SteppedLoop
from areal_hpc.workflow.text import EpisodeText, render_turn

__all__ = ["EpisodeRunner", "FinishedEpisode", "RunnerServices", "RunnerSettings", "Workflow", "render_turn"]

log = logging.getLogger("areal_hpc.workflow")

Workflow = Callable[[Episode], Awaitable[float | None]]
Service = TypeVar("Service")


def workflow_at(fn) -> str:
    """Where a workflow function is defined (file:line), for a failure raised on its behalf."""
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""


@dataclass
class RunnerSettings:
    workflow: object  # the config's WorkflowConfig: what built-in workflows read, `args` for the user's
    max_new_tokens: int  # rollout.max_new_tokens: a generate call's default budget
    max_context: int | None = None  # the model's context: no generate call runs past it
    chat: bool = False  # data.chat_template resolved: appended messages go through the template
    tool_memory_mb: int = 1024
    sandbox: str = "bwrap"  # workflow.tool_sandbox: the isolation tool calls run under
    tool_threads: int = 4  # tool calls waiting at once (each a sandboxed python3 process)
    config: object = None  # the run's whole Config: a runner-wide service builds its own settings from it


@dataclass(frozen=True)
class RunnerServices:
    """What a workflow's runner-wide service (`Episode.service`: the agent workflow's endpoint) may use of the
    runner: its settings, its tokenizer, and the two bridges between another thread and the episodes' loop."""

    settings: RunnerSettings
    tokenizer: object
    call_in_loop: Callable[..., None]  # from any thread: fn(*args) runs on the episodes' loop at its next pass
    wait: Callable[[concurrent.futures.Future], Awaitable]  # await a thread's job; cancelling the awaiter cancels it


class EpisodeRunner:
    """Episodes as tasks on a loop that runs one pass per `poll()`, between two engine steps (SteppedLoop says
    why). A generate call becomes a GenRequest handed to `submit` (the caller puts it into the engine);
    `deliver()` hands back the engine's output and wakes the episode. Episodes keep their own transcripts and
    counts; the runner offers them the raw calls: `sample`, `score`, `run_python` (and `service`).

    A call cancelled on its own while its episode goes on or ends (an agent's, as its session closes) is
    abandoned: the runner hands its request to `withdraw` (the caller takes it out of the engine) at the next
    poll or cancel. Without `withdraw`, it runs to its end in the engine and its output is dropped."""

    def __init__(
        self,
        workflow: Workflow,
        tokenizer,
        pool,
        submit: Callable[[list[GenRequest]], None],
        settings,
        withdraw: Callable[[list[RequestId]], None] | None = None,
    ):
        self.workflow = workflow
        self.withdraw = withdraw
        self.settings: RunnerSettings = settings
        self.text = EpisodeText(tokenizer, settings.chat)
        self.loop = SteppedLoop()
        self.requests = EngineRequests(submit, self.loop)
        self.rewards = RewardBatches(pool, self.loop)
        self.tools = ToolThreads(self.loop, settings.tool_threads, settings.tool_memory_mb, settings.sandbox)
        self.tasks: dict[Hashable, asyncio.Task] = {}  # episode key -> task
        self.finished: list[FinishedEpisode] = []
        wc = settings.workflow
        self.failures = FailureBudget(wc.max_failure_share, wc.failure_window)  # every episode's, held out too
        self.broken: EndpointLost | None = None
        self._logged: set[tuple[str, str]] = set()  # (kind, where) of the failures logged
        self._services: dict[Callable, object] = {}  # make -> the runner-wide service it made, closed with it

    # -- the caller's side -----------------------------------------------------------------------
    def start(self, key: Hashable, row: dict, prompt_ids: list[int], greedy: bool = False) -> None:
        """A new episode; its first request reaches `submit` at the next poll()."""
        if key in self.tasks:
            raise ValueError(f"episode {key!r} is already running")
        self.tasks[key] = self.loop.task(self._run(Episode(self, key, row, prompt_ids, greedy), self.failures.start()))

    def deliver(self, out: GenOutput) -> None:
        """An engine output for a request this runner submitted (none for a request cancelled meanwhile)."""
        self.requests.deliver(out)

    def poll(self, engine_idle: bool = False) -> list[FinishedEpisode]:
        """Run every episode that can go on until it waits again; the episodes that ended since the last poll.

        Cheap when nothing happened since the last poll (no start, no engine output, no reward or tool back).
        Reward calls wait for a batch unless `engine_idle` (nothing else would happen meanwhile).
        """
        self.loop.run_ready(len(self.tasks))
        self.rewards.flush(force=engine_idle)
        self._withdraw_abandoned()
        if self.broken is not None:
            raise self.broken
        if self.failures.over is not None:
            raise TooManyFailures(self.failures.over)
        done, self.finished = self.finished, []
        return done

    def cancel(self, keys: list[Hashable] | None = None) -> list[RequestId]:
        """Stop these episodes (None: all); the request ids they have in the engine, for the caller to interrupt."""
        keys = list(self.tasks) if keys is None else [k for k in keys if k in self.tasks]
        for k in keys:
            self.tasks.pop(k).cancel()
        rids = self.requests.drop(set(keys))
        self.loop.run_once()  # let the cancellations run (finally blocks, awaited futures)
        self.rewards.discard_unwanted()
        self._withdraw_abandoned()  # and calls cancelled alone before these episodes ended
        return rids

    def close(self) -> None:
        self.withdraw = None  # the caller's engine may be closed already: nothing leaves it any more
        self.cancel()
        for service in self._services.values():
            service.close()
        self.tools.close()
        self.loop.close()

    def _withdraw_abandoned(self) -> None:
        """Calls abandoned since the last time hold no engine slot: the caller withdraws them."""
        abandoned = self.requests.take_cancelled_alone()
        if abandoned and self.withdraw is not None:
            self.withdraw(abandoned)

    # -- an episode's life ----------------------------------------------------------------------
    async def _run(self, ep: Episode, seq: int) -> None:
        outcome = VOID  # until it is scored or fails (a rejection, a lost endpoint stay VOID)
        try:
            reward, failure = await self._attempt(ep)
            outcome = failure or (SCORED if reward is not None else VOID)
        except asyncio.CancelledError:
            outcome = CANCELLED
            raise
        except EndpointLost as e:  # no episode can go on: the rank fails (poll raises it)
            self.broken = self.broken or e
            return
        finally:  # a cancellation too: no try that started later may wait for it in the budget's window
            self.tasks.pop(ep.key, None)
            self.failures.end(seq, outcome)
        if failure is not None:
            ep.stats.add_failure(failure)
        self.finished.append(ep.finished(reward, failure))

    async def _attempt(self, ep: Episode) -> tuple[float | None, EpisodeFailure | None]:
        """The workflow's reward for the episode (None: rejected), or how it failed."""
        try:
            reward = await self.workflow(ep)
            if reward is None:
                return None, None
            try:
                return float(reward), None
            except (TypeError, ValueError):
                what = f"it returned {reward!r} ({type(reward).__name__}); return a float, or None to reject"
                raise EpisodeFailed(EpisodeFailure("bad result", what, workflow_at(self.workflow))) from None
        except (asyncio.CancelledError, EndpointLost):
            raise
        except EpisodeFailed as e:
            failure, trace = e.failure, False
        except Exception as e:  # a failing episode is counted and runs again (FailureBudget says when it is too many)
            failure, trace = EpisodeFailure("raised", f"{type(e).__name__}: {e}", user_frame(e)), True
        if (failure.kind, failure.where) not in self._logged:  # the first of each kind at each place
            self._logged.add((failure.kind, failure.where))
            log.warning("episode %s failed: %s (logged once)", ep.key, failure, exc_info=trace)
        return None, failure

    # -- the raw calls an Episode makes ------------------------------------------------------------
    async def sample(self, key: Hashable, tokens: list[int], budget: int, greedy: bool, stop: list[str]) -> GenOutput:
        """The engine continues `tokens` by up to `budget` tokens."""
        return await self.requests.sample(key, tokens, budget, greedy, stop)

    async def score(self, completion: str, row: dict) -> tuple[float, str, dict]:
        """reward.fn on (completion, row) in the reward pool: the reward, how the call ended, its extras."""
        return await self.rewards.score(completion, row)

    async def run_python(self, code: str, wall_s: float) -> ToolResult:
        """`code` under python3 in the sandbox, on a tool thread."""
        return await self.tools.run_python(code, wall_s)

    def service(self, make: Callable[[RunnerServices], Service]) -> Service:
        """The runner-wide service `make` makes (Episode.service): made once, at the first call."""
        if make not in self._services:
            services = RunnerServices(self.settings, self.text.tokenizer, self.loop.call_in_loop, self._wait)
            self._services[make] = make(services)
        return self._services[make]

    async def _wait(self, job: concurrent.futures.Future):
        """The result of work running on another thread (an agent on the endpoint's process); cancelling the
        episode that awaits it cancels the job."""
        try:
            return await self.loop.wait_woken(self.loop.from_thread(job))
        finally:
            job.cancel()
