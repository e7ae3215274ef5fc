"""Supervised process pool that scores reward batches off the caller's thread, safe against crashes and hangs."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import multiprocessing as mp
import pickle
import threading
import time
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool

from areal_hpc.reward.bounds import ERROR, TIMEOUT, Scorer, bounded_call
from areal_hpc.reward.scores import FailureLog, Scores, ScoringJob
from areal_hpc.reward.workers import _score_chunk, _WorkerGeneration

__all__ = ["RewardPool", "Scores"]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- pool


class _WorkUnit:
    """A chunk of (job, index) items sent to one worker as a single task."""

    __slots__ = ("items", "isolated", "submit_t", "budget_s", "gen")

    def __init__(self, items, isolated, budget_s, gen):
        self.items = items
        self.isolated = isolated
        self.submit_t = time.monotonic()
        self.budget_s = budget_s
        self.gen = gen


class RewardPool:
    """Scores (completion, reference) batches off the caller's thread in worker processes.

    Items are sent in small chunks, at most ``num_workers`` chunks in flight. Each item is
    bounded by ``timeout_s`` inside its worker (SIGALRM in the worker's main thread); a chunk
    that overruns its whole budget (a hang in C code, a crashed worker) gets the pool killed
    and rebuilt, its items are retried one at a time in isolation, and whichever item fails
    again scores 0.0. Results never raise: the returned futures always resolve to a list.

    ``scorer`` (reward/functions.py builds the run's) must be a picklable top-level function or object
    ``f(completion, reference) -> float``; its ``load()``, if it has one, runs once in each worker at
    start-up. Workers use the forkserver (else spawn) start method, never fork, so the pool is safe to
    create from processes that use torch or MPI; as with any spawn-style pool, a script that creates one
    needs an ``if __name__ == "__main__":`` guard (workers re-import the main module). ``cpus``: the
    cores the workers run on (None: wherever this process may run).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        *,
        scorer: Scorer,
        max_chunk: int = 8,
        hard_grace_s: float = 2.0,
        startup_grace_s: float = 120.0,
        start_method: str | None = None,
        cpus: frozenset[int] | None = None,
    ):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if not timeout_s or timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        try:
            pickle.dumps(scorer)
        except Exception as e:
            raise ValueError("scorer must be a picklable top-level function") from e
        self.scorer = scorer
        self.max_chunk = max(1, int(max_chunk))
        self.hard_grace_s = float(hard_grace_s)
        self.startup_grace_s = float(startup_grace_s)
        if start_method is None:
            start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        if start_method == "fork":
            raise ValueError("fork is unsafe with torch/MPI threads; use forkserver or spawn")
        self._ctx = mp.get_context(start_method)
        self.cpus = cpus

        self._lock = threading.Lock()
        self._wake: cf.Future = cf.Future()
        self._queue: collections.deque = collections.deque()  # (job, idx)
        self._suspects: collections.deque = collections.deque()  # (job, idx), run alone
        self._in_flight: dict[cf.Future, _WorkUnit] = {}
        self._closing = False
        self._closed = False
        self._dropping = False  # close(finish_queued=False): nothing queued is scored
        self._discards: list[tuple[cf.Future, set[int]]] = []  # discard(): handled by the supervisor thread
        self._consecutive_breaks = 0
        self.rebuilds = 0  # pool incarnations discarded after a crash or hang (for monitoring)
        self.failures = FailureLog()  # the first failure of each kind is logged, every one counted

        self._gen: _WorkerGeneration | None = None
        try:
            self._gen = _WorkerGeneration(self._ctx, self.num_workers, self.cpus, self.scorer)
        except Exception:
            logger.warning("RewardPool: no worker processes; scoring inline", exc_info=True)

        self._thread = threading.Thread(target=self._supervise, name="RewardPool", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public API

    def submit(self, completions: Sequence[str], references: Sequence) -> cf.Future:
        """Queues a batch; returns at once a Future resolving to the rewards, in order (a `Scores` list).

        A reference is what the scorer takes second: a reference answer (str) or a dataset row (dict).
        """
        completions, references = list(completions), list(references)
        if len(completions) != len(references):
            raise ValueError(f"{len(completions)} completions but {len(references)} references")
        # Other types would only score 0.0, and could fail to pickle: normalise them here.
        completions = [c if isinstance(c, str) else "" for c in completions]
        references = [r if isinstance(r, (str, dict)) else "" for r in references]
        job = ScoringJob(completions, references, self.failures)
        if not completions:
            job.future.set_result([])
            return job.future
        with self._lock:
            if self._closing:
                raise RuntimeError("RewardPool is closed")
            self._queue.extend((job, i) for i in range(len(completions)))
            self._wake_locked()
        return job.future

    def discard(self, future: cf.Future, indices: Sequence[int]) -> None:
        """Items of a submitted batch that nobody waits for any more (their episodes were cancelled): those still
        queued are never scored (they resolve as 0.0 errors, unlogged); one a worker runs already finishes."""
        with self._lock:
            self._discards.append((future, set(indices)))
            self._wake_locked()

    def _drop_discarded(self) -> None:
        """In the supervisor thread, which alone resolves items: take discarded items out of the queues."""
        with self._lock:
            discards, self._discards = self._discards, []
            gone = [
                (j, i) for j, i in [*self._queue, *self._suspects] if any(j.future is f and i in d for f, d in discards)
            ]
            for src in (self._queue, self._suspects):
                kept = [x for x in src if x not in gone]
                src.clear()
                src.extend(kept)
        for job, idx in gone:
            job.put(idx, 0.0, ERROR, "was discarded", log=False)  # not a failure of the reward function

    def score(self, completions: Sequence[str], references: Sequence[str]) -> list[float]:
        """Blocking convenience: submit(...).result()."""
        return self.submit(completions, references).result()

    def warmup(self, timeout: float | None = None) -> bool:
        """Blocks until every worker has loaded the scorer (its `load()`); True if they all did in time."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            gen = self._gen
            if gen is None or gen.is_ready():
                return True
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(0.02)

    def close(self, finish_queued: bool = True) -> None:
        """Finishes queued work, then stops the workers. Idempotent. finish_queued=False (a rank stopping, whose
        episodes no longer wait): queued items score 0.0 unlogged and the workers are killed mid-call."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._dropping = self._dropping or not finish_queued
            self._wake_locked()
        self._thread.join()
        gen, self._gen = self._gen, None
        if gen is not None and self._dropping:
            gen.kill()
        elif gen is not None:
            try:
                gen.executor.shutdown(wait=True, cancel_futures=True)
            except Exception:
                gen.kill()
        self._closed = True

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- supervisor

    def _wake_locked(self) -> None:
        if not self._wake.done():
            self._wake.set_result(None)

    def _supervise(self) -> None:
        while True:
            try:
                if not self._step():
                    return
            except BaseException:
                # A bug here must not strand callers: score what is left as 0.0 and go on.
                logger.exception("RewardPool supervisor error")
                self._fail_everything()

    def _step(self) -> bool:
        with self._lock:
            if self._wake.done():
                self._wake = cf.Future()
            wake = self._wake
            idle = not self._queue and not self._suspects and not self._in_flight
            if idle and self._closing:
                return False
        if self._dropping:
            self._fail_everything(log=False)
            return False
        if self._discards:
            self._drop_discarded()
            return True
        if idle:
            cf.wait([wake])
            return True

        if self._gen is None:
            self._score_inline_one()
            return True

        self._fill()
        if not self._in_flight:
            return True
        timeout = self._time_to_next_deadline()
        done, _ = cf.wait(list(self._in_flight) + [wake], timeout=timeout, return_when=cf.FIRST_COMPLETED)
        for fut in done:
            if fut is not wake and fut in self._in_flight:
                self._collect(fut)
        self._check_deadlines()
        return True

    def _score_inline_one(self) -> None:
        # Fallback when no process pool can be made: correct but unbounded in time.
        with self._lock:
            src = self._suspects or self._queue
            job, idx = src.popleft()
        job.put(idx, *bounded_call(self.scorer, job.completions[idx], job.references[idx], self.timeout_s))

    def _fill(self) -> None:
        gen = self._gen
        while True:
            with self._lock:
                if self._suspects:
                    # Suspects run alone so a crash or hang is pinned on exactly one item.
                    if self._in_flight:
                        return
                    items, isolated = [self._suspects.popleft()], True
                else:
                    if len(self._in_flight) >= self.num_workers or not self._queue:
                        return
                    # Smaller chunks near the end keep all workers busy until the last item.
                    n = max(1, min(self.max_chunk, -(-len(self._queue) // (2 * self.num_workers))))
                    items = [self._queue.popleft() for _ in range(min(n, len(self._queue)))]
                    isolated = False
            pairs = [(job.completions[i], job.references[i]) for job, i in items]
            budget = len(items) * self.timeout_s + self.hard_grace_s
            unit = _WorkUnit(items, isolated, budget, gen)
            try:
                fut = gen.executor.submit(_score_chunk, self.scorer, pairs, self.timeout_s)
            except Exception:
                # Pool already broken (a worker died between tasks): requeue and rebuild.
                with self._lock:
                    (self._suspects if isolated else self._queue).extendleft(reversed(items))
                self._on_crash()
                return
            self._in_flight[fut] = unit
            if isolated:
                return

    def _effective_deadline(self, unit: _WorkUnit) -> float:
        gen = unit.gen
        if not gen.is_ready():
            # Workers still importing: don't count that against the chunk.
            return gen.created_t + self.startup_grace_s + unit.budget_s
        return max(unit.submit_t, gen.ready_t) + unit.budget_s

    def _time_to_next_deadline(self) -> float:
        now = time.monotonic()
        nearest = min(self._effective_deadline(u) for u in self._in_flight.values())
        wait = max(0.0, nearest - now)
        if any(not u.gen.is_ready() for u in self._in_flight.values()):
            wait = min(wait, 0.05)  # poll the ready counter so deadlines start on time
        return wait

    def _collect(self, fut: cf.Future) -> None:
        unit = self._in_flight.pop(fut)
        exc = fut.exception()
        if exc is None:
            scores = fut.result()
            if isinstance(scores, list) and len(scores) == len(unit.items):
                self._consecutive_breaks = 0
                for (job, idx), (value, status, message, extras) in zip(unit.items, scores):
                    job.put(idx, float(value), status, message, extras)
                return
            exc = RuntimeError("malformed chunk result")
        self._blame(unit, f"crashed its worker process ({type(exc).__name__})")
        if isinstance(exc, BrokenProcessPool):
            self._on_crash()

    def _blame(self, unit: _WorkUnit, why: str) -> None:
        """An isolated item that failed scores 0.0 (a hang counts as a timeout, a crash as an error); a chunk
        that failed is retried item by item."""
        if unit.isolated:
            status = TIMEOUT if why.startswith("hung") else ERROR
            for job, idx in unit.items:
                job.put(idx, 0.0, status, why)
        else:
            with self._lock:
                self._suspects.extend(unit.items)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        expired = [f for f, u in self._in_flight.items() if now >= self._effective_deadline(u)]
        hung = False
        for fut in expired:
            if fut not in self._in_flight:
                continue  # already handled (a crash collected the whole incarnation)
            if fut.done():  # finished just in time
                self._collect(fut)
            else:
                self._blame(self._in_flight.pop(fut), f"hung past its hard deadline of {self.timeout_s:g} s")
                hung = True
        if not hung:
            return
        # A hung worker can only be stopped by killing the pool; innocent chunks go back in line.
        with self._lock:
            for unit in reversed(list(self._in_flight.values())):
                self._queue.extendleft(reversed(unit.items))
        self._in_flight.clear()
        self._rebuild(crashed=False)

    def _on_crash(self) -> None:
        # A worker died: every chunk of this incarnation is lost with it, culprit unknown.
        for unit in list(self._in_flight.values()):
            self._blame(unit, "crashed its worker process")
        self._in_flight.clear()
        self._rebuild(crashed=True)

    def _rebuild(self, crashed: bool) -> None:
        self.rebuilds += 1
        self._consecutive_breaks += 1
        old, self._gen = self._gen, None
        if old is not None:
            old.kill()
        if self._consecutive_breaks > 5:
            # Workers die without ever returning a result: fall back to scoring inline.
            logger.error("RewardPool: worker pool keeps failing; scoring inline from now on")
            return
        why = "crash" if crashed else "hang"
        logger.warning("RewardPool: rebuilding worker pool after a %s", why)
        try:
            self._gen = _WorkerGeneration(self._ctx, self.num_workers, self.cpus, self.scorer)
        except Exception:
            logger.exception("RewardPool: cannot rebuild worker pool; scoring inline")

    def _fail_everything(self, log: bool = True) -> None:
        with self._lock:
            items = list(self._queue) + list(self._suspects)
            self._queue.clear()
            self._suspects.clear()
        for unit in self._in_flight.values():
            items.extend(unit.items)
        self._in_flight.clear()
        for job, idx in items:
            if not job.future.done():
                job.failures = job.failures if log else None
                job.put(idx, 0.0, ERROR, "was lost: the reward pool's supervisor failed")
