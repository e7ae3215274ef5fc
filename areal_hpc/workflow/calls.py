"""Where an episode's waiting calls go: generate requests to the engine, rewards to the pool, tools to threads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

from areal_hpc.types import GenOutput, GenRequest, RequestId
from areal_hpc.workflow.records import ToolResult
from areal_hpc.workflow.stepped_loop import SteppedLoop
from areal_hpc.workflow.tools import sandboxed_python


class EngineRequests:
    """The runner's generate calls: each a GenRequest handed to `submit` (the caller puts it into the engine)
    and a future that `deliver` resolves. The only request table outside the engine: an output carries its
    request, and a request's id carries its episode's key."""

    def __init__(self, submit: Callable[[list[GenRequest]], None], loop: SteppedLoop):
        self.submit = submit
        self.loop = loop
        self.waiting: dict[RequestId, asyncio.Future] = {}
        self.cancelled_alone: list[RequestId] = []  # calls cancelled on their own: the runner withdraws them
        self._count = 0  # request ids are unique for the runner's life

    async def sample(self, key: Hashable, tokens: list[int], budget: int, greedy: bool, stop: list[str]) -> GenOutput:
        rid = RequestId(key, self._count)
        self._count += 1
        fut = self.waiting[rid] = self.loop.future()
        self.submit([GenRequest(rid, tokens, budget, greedy=greedy, stop=stop)])
        try:
            return await self.loop.wait_woken(fut)
        except asyncio.CancelledError:  # a call cancelled on its own (an agent's, its episode going on or ending)
            if self.waiting.pop(rid, None) is not None:
                self.cancelled_alone.append(rid)
            raise

    def deliver(self, out: GenOutput) -> None:
        """An engine output (none for a request cancelled meanwhile)."""
        fut = self.waiting.pop(out.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(out)
            self.loop.wake()

    def drop(self, keys: set) -> list[RequestId]:
        """The requests of these episodes, forgotten (their episodes are being cancelled): for the engine to drop."""
        rids = [rid for rid in self.waiting if rid.episode in keys]
        for rid in rids:
            del self.waiting[rid]
        return rids

    def take_cancelled_alone(self) -> list[RequestId]:
        out, self.cancelled_alone = self.cancelled_alone, []
        return out


class RewardBatches:
    """Reward calls go to the pool in batches, as a group's answers did before episodes: every submission costs
    the pool's supervisor thread time under the GIL that the engine's loop would otherwise have. A batch leaves
    once there are BATCH calls, the oldest has waited WAIT_S, or `flush(force=True)` (the engine is idle)."""

    BATCH, WAIT_S = 16, 0.02

    def __init__(self, pool, loop: SteppedLoop):
        self.pool = pool
        self.loop = loop
        self._waiting: list[tuple[str, dict, asyncio.Future]] = []  # calls not sent to the pool yet
        self._since = 0.0  # when the oldest of them came
        self._sent: dict = {}  # the pool's future of each batch sent -> its callers' futures

    async def score(self, completion: str, row: dict) -> tuple[float, str, dict]:
        """reward.fn on (completion, row): the reward, how the call ended (ok, timeout, error), its extras."""
        if not self._waiting:
            self._since = time.monotonic()
        fut = self.loop.future()
        self._waiting.append((completion, row, fut))
        return await self.loop.wait_woken(fut)

    def flush(self, force: bool) -> None:
        n = len(self._waiting)
        if not n or not (force or n >= self.BATCH or time.monotonic() - self._since >= self.WAIT_S):
            return
        batch, self._waiting = [b for b in self._waiting if not b[2].cancelled()], []
        if not batch:
            return
        job = self.pool.submit([c for c, _, _ in batch], [r for _, r, _ in batch])
        futures = self._sent[job] = [f for _, _, f in batch]
        job.add_done_callback(lambda j: self.loop.call_in_loop(self._settle, futures, j.result(), j))

    def discard_unwanted(self) -> None:
        """Calls nobody awaits any more (their episodes were cancelled) are not scored (a cut evaluation's)."""
        for job, futures in self._sent.items():
            if unwanted := [i for i, f in enumerate(futures) if f.cancelled()]:
                self.pool.discard(job, unwanted)

    def _settle(self, futures: list[asyncio.Future], scores, job) -> None:
        """In the loop: a batch is back; each caller still waiting gets its reward, status and extras."""
        self._sent.pop(job, None)
        for f, value, status, more in zip(futures, scores, scores.statuses, scores.extras):
            if not f.done():
                f.set_result((float(value), status, more))


class ToolThreads:
    """Sandboxed python3 runs on worker threads (made at the first call), `threads` waiting at once."""

    def __init__(self, loop: SteppedLoop, threads: int, memory_mb: int, sandbox: str):
        self.loop = loop
        self.limits = (threads, memory_mb, sandbox)
        self._pool: ThreadPoolExecutor | None = None

    async def run_python(self, code: str, wall_s: float) -> ToolResult:
        threads, memory_mb, sandbox = self.limits
        if self._pool is None:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tool")
        job = self._pool.submit(sandboxed_python, code, wall_s, memory_mb, sandbox)
        return await self.loop.wait_woken(self.loop.from_thread(job))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
