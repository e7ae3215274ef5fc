"""The episodes' event loop, run one bounded pass at a time by the thread that steps the engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Coroutine


class SteppedLoop:
    """An asyncio loop that never runs on its own: `run_ready()` runs the callbacks ready now, once, and returns.

    Why not `asyncio.run()` with the engine as one more task: the engine is synchronous (a step blocks for
    milliseconds in torch or vLLM) and is stepped by the rank's main thread, which also polls MPI between steps.
    Episodes must run between two engine steps, never during one and never on a thread of their own (the
    engine, the transcripts and the request table are not thread-safe, and a second busy thread would take
    GIL time from the engine). So the owner runs one pass per engine step: every episode that can go on runs
    until it waits again, and the next step starts with the requests those episodes made.

    A pass costs nothing when nothing happened: `wake()` (or `from_thread`) marks that something an episode
    waits for arrived (an engine output, a reward batch, a tool result). Episodes that await something of their
    own (asyncio.sleep, a task of theirs) are not woken by anything of ours: while there are any, a pass runs at
    least every IDLE_S.
    """

    IDLE_S = 0.01

    def __init__(self):
        self._loop = asyncio.new_event_loop()
        self._due = False  # something an episode waits for arrived: the next run_ready() makes a pass
        self._woken_waiters = 0  # coroutines awaiting a future of ours (`wait_woken`): whatever wakes them sets _due
        self._last = 0.0

    def task(self, coro: Coroutine) -> asyncio.Task:
        """A new task; it first runs at the next pass."""
        self._due = True
        return self._loop.create_task(coro)

    def future(self) -> asyncio.Future:
        return self._loop.create_future()

    def wake(self) -> None:
        """Something an episode waits for is here (a future of ours was resolved): the next run_ready() runs."""
        self._due = True

    async def wait_woken(self, fut: asyncio.Future):
        """Await a future that is resolved with a `wake()`: no idle pass needs to run for this waiter."""
        self._woken_waiters += 1
        try:
            return await fut
        finally:
            self._woken_waiters -= 1

    def run_ready(self, tasks: int) -> None:
        """One pass if something arrived, or if some of the `tasks` running wait for something of their own and
        IDLE_S passed since the last pass."""
        waits_elsewhere = tasks > self._woken_waiters
        if self._due or (waits_elsewhere and time.monotonic() - self._last > self.IDLE_S):
            self.run_once()

    def run_once(self) -> None:
        """One pass: every callback ready now runs (an episode goes on until it waits again). What those
        callbacks schedule runs at the next pass, so a pass is bounded."""
        self._due, self._last = False, time.monotonic()
        # stop() before run_forever(): the loop runs the callbacks already scheduled, once, and returns (asyncio's
        # documented behaviour of loop.stop)
        self._loop.stop()
        self._loop.run_forever()

    def call_in_loop(self, fn: Callable, *args) -> None:
        """From any thread: run fn(*args) at the next pass (nothing, once the loop is closed). What fn wakes or
        starts runs at the pass after."""

        def run():
            fn(*args)
            self._due = True

        try:
            self._loop.call_soon_threadsafe(run)
            self._due = True  # set after the callback is queued: the pass that sees it runs it
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def from_thread(self, job: concurrent.futures.Future) -> asyncio.Future:
        """A future of this loop with the result (or exception) of work on another thread (await it: `wait_woken`)."""
        done = self.future()
        job.add_done_callback(lambda j: self.call_in_loop(_settle, done, j))
        return done

    def close(self) -> None:
        self._loop.close()


def _settle(fut: asyncio.Future, job: concurrent.futures.Future) -> None:
    """In the loop: a thread's job is done; its waiter (if still waiting) gets the result or the exception."""
    if fut.done():
        return
    if job.cancelled():  # cancelled on its own thread (its loop shutting down): a failure, not the episode's
        fut.set_exception(RuntimeError("the job was cancelled on its thread"))
    elif job.exception() is not None:
        fut.set_exception(job.exception())
    else:
        fut.set_result(job.result())
