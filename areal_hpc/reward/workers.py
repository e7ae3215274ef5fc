"""RewardPool's worker processes: their initializer, the chunk task they run, and one executor generation."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import signal
import time

from areal_hpc.reward.bounds import Scorer, bounded_call
from areal_hpc.rundir.lifetime import exit_with

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- worker side

_READY_COUNTER = None


def _worker_init(
    ready_counter, cpus: frozenset[int] | None = None, scorer: Scorer | None = None, owner: int | None = None
) -> None:
    # The scorer's load (math-verify's import and regexes, the user's function and what it imports) once per
    # worker, not inside the first call's reward.timeout_s; a scorer that does not use math-verify never loads it
    global _READY_COUNTER
    _READY_COUNTER = ready_counter
    if owner is not None:  # the pool's process (a generator rank) died, killed or not: so does this worker
        exit_with(owner)
    if cpus:  # off the cores the caller keeps for itself (a generator's engine)
        os.sched_setaffinity(0, cpus)
    try:
        # The parent handles Ctrl-C and shuts us down; a KeyboardInterrupt here only adds noise.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if (load := getattr(scorer, "load", None)) is not None:
            load()
    except BaseException:  # a reward function that cannot load fails its calls, each counted as an error
        logger.debug("reward worker warm-up failed", exc_info=True)
    finally:
        try:
            with ready_counter.get_lock():
                ready_counter.value += 1
        except Exception:
            pass


def _worker_ping() -> int:
    return os.getpid()


def _score_chunk(scorer: Scorer, pairs: list[tuple[str, object]], timeout_s: float) -> list[tuple]:
    """(reward, "ok" | "timeout" | "error", message) per (completion, reference) pair."""
    return [bounded_call(scorer, c, r, timeout_s) for c, r in pairs]


class _WorkerGeneration:
    """One ProcessPoolExecutor incarnation; rebuilt whenever a worker crashes or hangs."""

    def __init__(self, ctx, num_workers: int, cpus: frozenset[int] | None = None, scorer: Scorer | None = None):
        self.created_t = time.monotonic()
        self.ready_t: float | None = None
        self.num_workers = num_workers
        self.counter = ctx.Value("i", 0)
        self.executor = cf.ProcessPoolExecutor(
            max_workers=num_workers,
            mp_context=ctx,
            initializer=_worker_init,
            initargs=(self.counter, cpus, scorer, os.getpid()),
        )
        # Workers are spawned on demand: one ping per worker starts them all now, in the
        # background, so their import cost overlaps with whatever the caller does next.
        try:
            self.pings = [self.executor.submit(_worker_ping) for _ in range(num_workers)]
        except BaseException:
            self.executor.shutdown(wait=False, cancel_futures=True)
            raise

    def is_ready(self) -> bool:
        if self.ready_t is None and self.counter.value >= self.num_workers:
            self.ready_t = time.monotonic()
        return self.ready_t is not None

    def kill(self) -> None:
        procs = list((getattr(self.executor, "_processes", None) or {}).values())
        for p in procs:
            try:
                p.kill()
            except Exception:
                pass
        try:
            # waits for the executor's thread to see the workers dead (at once) and let go of its queues: their
            # named semaphores are unlinked only when freed, and a rank that leaves by os._exit while the thread
            # still holds them leaves them to the resource tracker ("5 leaked semaphore objects" in its log)
            self.executor.shutdown(wait=True, cancel_futures=True)
        except Exception:
            pass
