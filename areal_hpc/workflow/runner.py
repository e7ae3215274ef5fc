"""Runs many episodes at once as asyncio tasks over a step-driven engine, stepped by the generator's own loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from areal_hpc.model import text_decoder
from areal_hpc.prompts import after_assistant_turn
from areal_hpc.types import GenOutput, GenRequest
from areal_hpc.workflow.episode import Episode
from areal_hpc.workflow.records import Completion, EpisodeStats, Segment, ToolResult
from areal_hpc.workflow.tools import sandboxed_python

log = logging.getLogger("areal_hpc.workflow")

Workflow = Callable[[Episode], Awaitable[float | None]]


class WorkflowError(RuntimeError):
    """The workflow raised: a bug in episode code stops the run (one line; the traceback is in the rank's log)."""


@dataclass
class RunnerSettings:
    workflow: object  # the config's WorkflowConfig: what built-in workflows read, `args` for the user's
    max_new_tokens: int  # rollout.max_new_tokens: a generate call's default budget
    max_context: int | None = None  # the model's context: no generate call runs past it
    chat: bool = False  # data.chat_template resolved: appended messages go through the template
    tool_memory_mb: int = 1024
    sandbox: str = "bwrap"  # reward.sandbox: the isolation tool calls run under
    tool_threads: int = 4  # tool calls waiting at once (each a sandboxed python3 process)
    temperature: float = 1.0  # rollout.temperature and top_p: what the agent endpoint serves, never another
    top_p: float = 1.0
    model_name: str = "policy"  # what the agent endpoint lists as its model


@dataclass
class FinishedEpisode:
    key: str
    reward: float | None  # None: the workflow rejected the episode
    segments: list[Segment]  # the last transcript
    stats: EpisodeStats
    finish_reason: str  # of its last generate call
    t_start: float
    t_end: float
    branches: list[list[Segment]] = field(default_factory=list)  # earlier transcripts (Episode.branch)

    @property
    def transcripts(self) -> list[list[Segment]]:
        """Every transcript the model sampled in (at least the last one): each becomes a trajectory."""
        sampled = [t for t in self.branches + [self.segments] if any(s.trained for s in t)]
        return sampled or [self.segments]

    @property
    def sampled(self) -> list[Segment]:
        """Every segment the model sampled, trained or not."""
        return [s for t in self.branches + [self.segments] for s in t if s.sampled]


class EpisodeRunner:
    """Episodes as tasks on a private event loop that never runs on its own: `poll()` runs what is ready, once,
    between two engine steps. A generate call becomes a GenRequest handed to `submit` (the generator puts it
    into the engine); `deliver()` hands back the engine's output and wakes the episode."""

    # a workflow may await things of its own (asyncio.sleep, a thread): while one does, the loop runs at least
    # this often (episodes that wait only for the engine, a reward or a tool are woken by what they wait for)
    IDLE_POLL_S = 0.01
    # reward calls go to the pool in batches, as a group's answers did before episodes: every submission costs
    # the pool's supervisor thread time under the GIL that the engine's loop would otherwise have
    REWARD_BATCH, REWARD_WAIT_S = 16, 0.02

    def __init__(self, workflow: Workflow, tokenizer, pool, submit: Callable[[list[GenRequest]], None], settings):
        self.workflow = workflow
        self.tokenizer = tokenizer
        self.decode = text_decoder(tokenizer)
        self.pool = pool
        self.submit = submit
        self.settings: RunnerSettings = settings
        self.loop = asyncio.new_event_loop()
        self.tasks: dict[str, asyncio.Task] = {}  # episode key -> task
        self.waiting: dict[str, tuple[asyncio.Future, str]] = {}  # request id -> (its future, episode key)
        self.finished: list[FinishedEpisode] = []
        self.calls = 0  # request ids are unique for the runner's life: f"{key}#{n}"
        self.failure: WorkflowError | None = None
        self.abandoned: list[str] = []  # requests whose call was cancelled alone: the caller takes them out (`take`)
        self.due = False  # something happened that an episode waits for: the next poll runs the loop
        self.parked = 0  # episodes waiting for something of the runner's (the engine, a reward, a tool)
        self.last_run = 0.0
        self._tools: ThreadPoolExecutor | None = None
        self._turn_cache: dict[tuple[str, str], list[int]] = {}
        self._unk = getattr(tokenizer, "unk_token_id", None)  # None: a vocabulary that spells everything (bytes)
        self._unk_warned = False
        self._rewards: list[tuple[str, dict, asyncio.Future]] = []  # reward calls not sent to the pool yet
        self._scoring: dict = {}  # the pool's future of each batch sent -> the episodes' futures waiting for it
        self._rewards_since = 0.0
        self._shared: dict[str, object] = {}  # what a workflow keeps per runner (`shared`), closed with it

    # -- the generator's side ----------------------------------------------------------------------
    def start(self, key: str, row: dict, prompt_ids: list[int], greedy: bool = False) -> None:
        """A new episode; its first request reaches `submit` at the next poll()."""
        if key in self.tasks:
            raise ValueError(f"episode {key!r} is already running")
        ep = Episode(self, key, row, prompt_ids, greedy)
        self.tasks[key] = self.loop.create_task(self._run(ep))
        self.due = True

    def deliver(self, out: GenOutput) -> None:
        """An engine output for a request this runner submitted (none for a request cancelled meanwhile)."""
        fut, _ = self.waiting.pop(out.request_id, (None, None))
        if fut is not None and not fut.done():
            fut.set_result(out)
            self.due = True

    def poll(self, engine_idle: bool = False) -> list[FinishedEpisode]:
        """Run every episode that can go on until it waits again; the episodes that ended since the last poll.

        Cheap when nothing happened since the last poll (no start, no engine output, no reward or tool back).
        Reward calls wait for a batch unless `engine_idle` (nothing else would happen meanwhile).
        """
        waits_elsewhere = len(self.tasks) > self.parked
        if self.due or (waits_elsewhere and time.monotonic() - self.last_run > self.IDLE_POLL_S):
            self._run_once()
        self._flush_rewards(force=engine_idle)
        # episodes may also have ended in a pass that cancel() ran
        if self.failure is not None:
            raise self.failure
        done, self.finished = self.finished, []
        return done

    def take_abandoned(self) -> list[str]:
        """The requests of calls cancelled alone since the last take: for the caller to interrupt in the engine."""
        out, self.abandoned = self.abandoned, []
        return out

    def cancel(self, keys: list[str] | None = None) -> list[str]:
        """Stop these episodes (None: all); the request ids they have in the engine, for the caller to interrupt."""
        keys = list(self.tasks) if keys is None else [k for k in keys if k in self.tasks]
        for k in keys:
            self.tasks.pop(k).cancel()
        gone = set(keys)
        rids = [rid for rid, (_, k) in self.waiting.items() if k in gone]
        for rid in rids:
            del self.waiting[rid]
        self._run_once()  # let the cancellations run (finally blocks, awaited futures)
        for job, futures in self._scoring.items():  # a reward nobody awaits is not scored (a cut evaluation's)
            if unwanted := [i for i, f in enumerate(futures) if f.cancelled()]:
                self.pool.discard(job, unwanted)
        return rids

    def _run_once(self) -> None:
        """One pass of the event loop: every callback ready now runs (an episode goes on until it waits)."""
        self.due, self.last_run = False, time.monotonic()
        self.loop.call_soon(self.loop.stop)
        self.loop.run_forever()

    def close(self) -> None:
        self.cancel()
        for thing in self._shared.values():
            thing.close()
        if self._tools is not None:
            self._tools.shutdown(wait=False, cancel_futures=True)
        self.loop.close()

    # -- an episode's life ----------------------------------------------------------------------------
    async def _run(self, ep: Episode) -> None:
        try:
            reward = await self.workflow(ep)
            if reward is not None:
                try:
                    reward = float(reward)
                except (TypeError, ValueError):
                    raise TypeError(f"it returned {reward!r}; return a float, or None to reject") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("workflow failed in episode %s", ep.key)
            self.failure = self.failure or WorkflowError(
                f"workflow failed in episode {ep.key}: {type(e).__name__}: {e}"
            )
            return
        finally:
            self.tasks.pop(ep.key, None)
        self.finished.append(
            FinishedEpisode(ep.key, reward, ep.segments, ep.stats, ep.last_finish, ep.t_start, time.time(), ep.branches)
        )

    # -- what Episode's awaitables do -----------------------------------------------------------------
    async def generate(self, ep: Episode, max_new_tokens: int | None, stop: list[str] | None) -> Completion:
        tokens = ep.tokens
        budget = max_new_tokens or self.settings.max_new_tokens
        if self.settings.max_context:
            budget = min(budget, self.settings.max_context - len(tokens))
        if budget <= 0:
            return Completion([], [], [], "length", "")
        rid = f"{ep.key}#{self.calls}"
        self.calls += 1
        fut = self.loop.create_future()
        self.waiting[rid] = (fut, ep.key)
        self.submit([GenRequest(rid, tokens, budget, greedy=ep.greedy, stop=list(stop or []))])
        try:
            out: GenOutput = await self._parked(fut)
        except asyncio.CancelledError:  # a call cancelled on its own (an agent's, its episode going on or ending)
            if self.waiting.pop(rid, None) is not None:
                self.abandoned.append(rid)
            raise
        text = self.decode(out.output_ids)
        reason = "stop" if out.finish_reason == "stop" else "length"
        return Completion(out.output_ids, out.output_logprobs, out.output_versions, reason, text)

    async def reward(self, ep: Episode, completion: str) -> float:
        t0 = time.time()
        fut = self.loop.create_future()
        if not self._rewards:
            self._rewards_since = time.monotonic()
        self._rewards.append((completion, ep.row, fut))
        value, status, extras = await self._parked(fut)
        st = ep.stats
        st.reward_timeouts += status == "timeout"
        st.reward_errors += status == "error"
        st.logged.update((f"reward/{k}", v) for k, v in extras.items())
        st.reward_span = (st.reward_span[0] if st.reward_span else t0, time.time())
        return value

    async def _parked(self, fut: asyncio.Future):
        """Await a future the runner resolves itself: no idle poll needs to run for this episode meanwhile."""
        self.parked += 1
        try:
            return await fut
        finally:
            self.parked -= 1

    def _flush_rewards(self, force: bool) -> None:
        """Waiting reward calls go to the pool as one batch once there are REWARD_BATCH, the oldest has waited
        REWARD_WAIT_S, or `force`."""
        n = len(self._rewards)
        if not n or not (
            force or n >= self.REWARD_BATCH or time.monotonic() - self._rewards_since >= self.REWARD_WAIT_S
        ):
            return
        batch, self._rewards = [b for b in self._rewards if not b[2].cancelled()], []
        if not batch:
            return
        job = self.pool.submit([c for c, _, _ in batch], [r for _, r, _ in batch])
        futures = self._scoring[job] = [f for _, _, f in batch]
        job.add_done_callback(lambda j: self.call_in_loop(self._settle, futures, j.result(), j))

    def _settle(self, futures: list[asyncio.Future], scores, job=None) -> None:
        """In the loop: a reward batch is back; each waiting episode gets (its reward, how its call ended, the
        extras it returned)."""
        self._scoring.pop(job, None)
        for f, value, status, more in zip(futures, scores, scores.statuses, scores.extras):
            if not f.done():  # a cancelled episode no longer waits
                f.set_result((float(value), status, more))
        self.due = True  # the episodes it woke run at the next pass, not this one

    def _settle_tool(self, fut: asyncio.Future, job) -> None:
        """In the loop: a tool call is back; its waiting episode gets the result (or its exception)."""
        if not fut.done():
            if job.cancelled():  # cancelled on its own thread (its loop shutting down): a failure, not the episode's
                fut.set_exception(RuntimeError("the job was cancelled on its thread"))
            elif job.exception() is not None:
                fut.set_exception(job.exception())
            else:
                fut.set_result(job.result())
        self.due = True

    def call_in_loop(self, fn, *args) -> None:
        """From another thread: run fn at the next poll (nothing, once the runner is closed). What fn wakes or
        starts (a task of its own: an agent's call) runs at the poll after."""

        def run():
            fn(*args)
            self.due = True

        try:
            self.loop.call_soon_threadsafe(run)
            self.due = True  # set after the callback is queued: the poll that sees it runs it
        except RuntimeError:  # the loop is closed: no episode waits any more
            pass

    def shared(self, name: str, make: Callable[[], object]):
        """What a workflow keeps for all its episodes on this runner (the agent workflow's endpoint): made once by
        `make()`, closed (its `close()`) when the runner closes."""
        if name not in self._shared:
            self._shared[name] = make()
        return self._shared[name]

    async def wait(self, job: concurrent.futures.Future):
        """The result of work running on another thread (an agent on the endpoint's loop); cancelling the episode
        cancels the job."""
        done = self.loop.create_future()
        job.add_done_callback(lambda j: self.call_in_loop(self._settle_tool, done, j))
        try:
            return await self._parked(done)
        finally:
            job.cancel()

    async def run_python(self, ep: Episode, code: str, timeout_s: float | None) -> ToolResult:
        if self._tools is None:
            self._tools = ThreadPoolExecutor(self.settings.tool_threads, thread_name_prefix="tool")
        wall = timeout_s or self.settings.workflow.tool_timeout_s
        call = (code, wall, self.settings.tool_memory_mb, self.settings.sandbox)
        done, t0 = self.loop.create_future(), time.time()
        job = self._tools.submit(sandboxed_python, *call)
        job.add_done_callback(lambda j: self.call_in_loop(self._settle_tool, done, j))
        result = await self._parked(done)
        ep.stats.add_tool_call(result, t0, time.time())
        return result

    def check_known(self, text: str, ids: list[int]) -> None:
        """Text a workflow appends that the vocabulary cannot spell becomes unknown tokens: the model never sees
        it. Warned once per runner (a run's generator), with the text."""
        if self._unk_warned or self._unk is None or self._unk not in ids:
            return
        self._unk_warned = True
        log.warning(
            "text a workflow appended maps to the model's unknown token %s in %d of its %d tokens, so the model "
            "never sees it: %r (the tiny demo model's vocabulary: docs/workflows.md; warned once)",
            self.tokenizer.convert_ids_to_tokens(self._unk),
            ids.count(self._unk),
            len(ids),
            text,
        )

    def render_turn(self, role: str, content: str) -> list[int]:
        """Token ids of one new chat message plus the assistant's next-turn prompt (rendered once, cached)."""
        key = (role, content)
        if key not in self._turn_cache:
            self._turn_cache[key] = render_turn(self.tokenizer, role, content, self.settings.chat)
        return list(self._turn_cache[key])


def episode_of(request_id: str) -> str:
    """The episode key of one of the runner's request ids ("{key}#{n}")."""
    return request_id.rpartition("#")[0]


def render_turn(tokenizer, role: str, content: str, chat: bool) -> list[int]:
    """The chat template's text for one more message after an assistant turn, with the next assistant prompt
    (`content` alone without a template)."""
    if not chat:
        return list(tokenizer.encode(content, add_special_tokens=False))
    text = after_assistant_turn(tokenizer, [{"role": role, "content": content}])
    return list(tokenizer.encode(text, add_special_tokens=False))
