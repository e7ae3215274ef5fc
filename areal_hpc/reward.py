"""Rule-based math reward (math-verify) and a crash/timeout-safe process pool for batches."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import math
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Sequence

__all__ = ["math_reward", "RewardPool", "extract_last_boxed"]

logger = logging.getLogger(__name__)

# Only the tail of a completion is parsed: the final answer lives there, and math-verify's
# regexes / LaTeX parser get slow on long or deeply nested input.
MAX_COMPLETION_CHARS = 2000
MAX_REFERENCE_CHARS = 1000
# Real answers never nest braces this deep; deeper input is adversarial and very slow to parse.
MAX_BRACE_DEPTH = 64

Scorer = Callable[[str, str], float]


# --------------------------------------------------------------------------- math-verify glue

_MV = None  # (parse, verify, LatexExtractionConfig, ExprExtractionConfig), imported lazily
_MV_LOCK = threading.Lock()


class _DropTimeoutDisabledWarning(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning: we bound time ourselves, on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return "Timeout is disabled" not in record.getMessage()
        except Exception:
            return True


def _math_verify():
    # Lazy: importing sympy costs ~0.3-1 s, which callers that only build a RewardPool never need.
    global _MV
    if _MV is None:
        with _MV_LOCK:
            if _MV is None:
                from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

                for name in ("math_verify.parser", "math_verify.grader"):
                    logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
                _MV = (parse, verify, LatexExtractionConfig, ExprExtractionConfig)
    return _MV


_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``) in text, else None."""
    best = -1
    for cmd in _BOX_COMMANDS:
        best = max(best, text.rfind(cmd + "{"))
    # Scan right-to-left so an unbalanced trailing "\boxed{" does not hide an earlier good one.
    while best >= 0:
        start = text.index("{", best) + 1
        depth, i = 1, start
        while i < len(text):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
            i += 1
        prev = -1
        for cmd in _BOX_COMMANDS:
            prev = max(prev, text.rfind(cmd + "{", 0, best))
        best = prev
    return None


def _too_deep(s: str) -> bool:
    depth = 0
    for ch in s:
        if ch == "{":
            depth += 1
            if depth > MAX_BRACE_DEPTH:
                return True
        elif ch == "}":
            depth -= 1
    return False


def _has_math_delims(s: str) -> bool:
    return "$" in s or "\\boxed" in s or "\\fbox" in s or "\\[" in s or "\\(" in s


def _parse(s: str) -> list:
    parse, _, latex_cfg, expr_cfg = _math_verify()
    # Timeouts off: math-verify's SIGALRM timer would cancel ours (and fails off the main thread).
    return parse(
        s,
        extraction_config=[latex_cfg(), expr_cfg()],
        parsing_timeout=None,
        raise_on_error=False,
    )


def _parse_bare(s: str) -> list:
    """Parses an answer given without delimiters ("1/2", "\\dfrac{1}{2}", "x = 3")."""
    if _has_math_delims(s):
        return _parse(s)
    # Bare LaTeX ("\dfrac{1}{2}", "3\sqrt{2}") is only understood inside math delimiters.
    return _parse("$" + s + "$") or _parse(s)


def _math_reward_unbounded(completion: str, reference: str) -> float:
    if not isinstance(completion, str) or not isinstance(reference, str):
        return 0.0
    completion = completion[-MAX_COMPLETION_CHARS:]
    reference = reference[-MAX_REFERENCE_CHARS:].strip()
    if not completion.strip() or not reference:
        return 0.0

    boxed_ref = extract_last_boxed(reference)
    gold_src = boxed_ref.strip() if boxed_ref is not None else reference
    if not gold_src or _too_deep(gold_src):
        return 0.0
    gold = _parse_bare(gold_src)
    if not gold:
        return 0.0

    boxed = extract_last_boxed(completion)
    if boxed is not None:
        boxed = boxed.strip()
        if not boxed or _too_deep(boxed):
            return 0.0
        pred = _parse("\\boxed{" + boxed + "}")
    else:
        if _too_deep(completion):
            return 0.0
        pred = _parse(completion)
    if not pred:
        return 0.0

    _, verify, _, _ = _math_verify()
    ok = verify(gold, pred, timeout_seconds=None, raise_on_error=False)
    return 1.0 if ok else 0.0


# --------------------------------------------------------------------------- time bounding


class _ScoreTimeout(BaseException):
    """Raised by our SIGALRM handler; BaseException so library `except Exception` cannot eat it."""


_ALARM_ACTIVE = False  # only touched from the main thread (signals only work there)


def _can_use_alarm() -> bool:
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and not _ALARM_ACTIVE
    )


def _bounded_call(fn: Scorer, completion: str, reference: str, timeout_s: float | None) -> float:
    """fn(completion, reference) as a finite float; 0.0 on any error or after timeout_s.

    On the main thread the whole call is bounded by an ITIMER_REAL alarm (the caller's own
    alarm, if any, is restored afterwards). Off the main thread signals are unavailable, so
    the call is unbounded here and RewardPool's hard per-item deadline is the guard.
    """
    global _ALARM_ACTIVE
    try:
        if not timeout_s or timeout_s <= 0 or not _can_use_alarm():
            return _as_reward(fn(completion, reference))

        armed = [True]

        def _on_alarm(signum, frame):
            if armed[0]:
                raise _ScoreTimeout()

        prev_delay, prev_interval = signal.getitimer(signal.ITIMER_REAL)
        # A caller's pending alarm that is due sooner caps our budget; it is re-fired below.
        delay = timeout_s if prev_delay <= 0 else min(timeout_s, prev_delay)
        t0 = time.monotonic()
        prev_handler = signal.signal(signal.SIGALRM, _on_alarm)
        _ALARM_ACTIVE = True
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, delay)
                return _as_reward(fn(completion, reference))
            finally:
                armed[0] = False
        except _ScoreTimeout:
            return 0.0
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            restore = prev_handler if prev_handler is not None else signal.SIG_DFL
            signal.signal(signal.SIGALRM, restore)
            _ALARM_ACTIVE = False
            if prev_delay > 0:
                left = max(prev_delay - (time.monotonic() - t0), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left, prev_interval)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        # _ScoreTimeout, any scorer error, math-verify's BaseException-derived timeout...
        logger.debug("reward scorer failed", exc_info=True)
        return 0.0


def _as_reward(x) -> float:
    try:
        v = float(x)
    except Exception:
        return 0.0
    return v if math.isfinite(v) else 0.0


def math_reward(completion: str, reference: str, timeout_s: float = 5.0) -> float:
    """1.0 if the completion's final answer equals the reference mathematically, else 0.0.

    The final answer is the last ``\\boxed{...}`` when there is one, otherwise math-verify's
    extraction from the last MAX_COMPLETION_CHARS characters. Never raises. On the main thread
    the call is bounded by timeout_s (SIGALRM); elsewhere run it under RewardPool for a bound.
    """
    return _bounded_call(_math_reward_unbounded, completion, reference, timeout_s)


# --------------------------------------------------------------------------- worker side

_READY_COUNTER = None


def _worker_init(ready_counter) -> None:
    # Import + first parse compile math-verify's regexes once per worker, not per item.
    global _READY_COUNTER
    _READY_COUNTER = ready_counter
    try:
        # The parent handles Ctrl-C and shuts us down; a KeyboardInterrupt here only adds noise.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _math_reward_unbounded("\\boxed{\\frac{1}{2}}", "0.5")
    except BaseException:
        logger.debug("reward worker warm-up failed", exc_info=True)
    finally:
        try:
            with ready_counter.get_lock():
                ready_counter.value += 1
        except Exception:
            pass


def _worker_ping() -> int:
    return os.getpid()


def _score_chunk(
    scorer: Scorer | None, pairs: list[tuple[str, str]], timeout_s: float
) -> list[float]:
    fn = _math_reward_unbounded if scorer is None else scorer
    return [_bounded_call(fn, c, r, timeout_s) for c, r in pairs]


# --------------------------------------------------------------------------- pool


class _Job:
    __slots__ = ("future", "completions", "references", "scores", "remaining")

    def __init__(self, completions: list[str], references: list[str]):
        self.future: cf.Future = cf.Future()
        self.future.set_running_or_notify_cancel()  # results are always delivered; no cancel
        self.completions = completions
        self.references = references
        self.scores: list[float] = [0.0] * len(completions)
        self.remaining = len(completions)

    def put(self, idx: int, value: float) -> None:
        self.scores[idx] = value
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(self.scores)


class _Unit:
    """A chunk of (job, index) items sent to one worker as a single task."""

    __slots__ = ("items", "isolated", "submit_t", "budget_s", "gen")

    def __init__(self, items, isolated, budget_s, gen):
        self.items = items
        self.isolated = isolated
        self.submit_t = time.monotonic()
        self.budget_s = budget_s
        self.gen = gen


class _Generation:
    """One ProcessPoolExecutor incarnation; rebuilt whenever a worker crashes or hangs."""

    def __init__(self, ctx, num_workers: int):
        self.created_t = time.monotonic()
        self.ready_t: float | None = None
        self.num_workers = num_workers
        self.counter = ctx.Value("i", 0)
        self.executor = cf.ProcessPoolExecutor(
            max_workers=num_workers,
            mp_context=ctx,
            initializer=_worker_init,
            initargs=(self.counter,),
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
            self.executor.shutdown(wait=False, cancel_futures=True)
        except Exception:
            pass


class RewardPool:
    """Scores (completion, reference) batches off the caller's thread in worker processes.

    Items are sent in small chunks, at most ``num_workers`` chunks in flight. Each item is
    bounded by ``timeout_s`` inside its worker (SIGALRM in the worker's main thread); a chunk
    that overruns its whole budget (a hang in C code, a crashed worker) gets the pool killed
    and rebuilt, its items are retried one at a time in isolation, and whichever item fails
    again scores 0.0. Results never raise: the returned futures always resolve to a list.

    ``scorer`` (default: math_reward's core) must be a picklable top-level function
    ``f(completion, reference) -> float``. Workers use the forkserver (else spawn) start
    method, never fork, so the pool is safe to create from processes that use torch or MPI;
    as with any spawn-style pool, a script that creates one needs an
    ``if __name__ == "__main__":`` guard (workers re-import the main module).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        scorer: Scorer | None = None,
        max_chunk: int = 8,
        hard_grace_s: float = 2.0,
        startup_grace_s: float = 120.0,
        start_method: str | None = None,
    ):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if not timeout_s or timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        if scorer is not None:
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

        self._lock = threading.Lock()
        self._wake: cf.Future = cf.Future()
        self._queue: collections.deque = collections.deque()  # (job, idx)
        self._suspects: collections.deque = collections.deque()  # (job, idx), run alone
        self._in_flight: dict[cf.Future, _Unit] = {}
        self._closing = False
        self._closed = False
        self._consecutive_breaks = 0
        self.rebuilds = 0  # pool incarnations discarded after a crash or hang (for monitoring)

        self._gen: _Generation | None = None
        try:
            self._gen = _Generation(self._ctx, self.num_workers)
        except Exception:
            logger.warning("RewardPool: no worker processes; scoring inline", exc_info=True)

        self._thread = threading.Thread(target=self._supervise, name="RewardPool", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public API

    def submit(self, completions: Sequence[str], references: Sequence[str]) -> cf.Future:
        """Queues a batch; returns at once a Future resolving to the rewards, in order."""
        completions, references = list(completions), list(references)
        if len(completions) != len(references):
            raise ValueError(
                f"{len(completions)} completions but {len(references)} references"
            )
        # Non-strings would only score 0.0, and could fail to pickle: normalise them here.
        completions = [c if isinstance(c, str) else "" for c in completions]
        references = [r if isinstance(r, str) else "" for r in references]
        job = _Job(completions, references)
        if not completions:
            job.future.set_result([])
            return job.future
        with self._lock:
            if self._closing:
                raise RuntimeError("RewardPool is closed")
            self._queue.extend((job, i) for i in range(len(completions)))
            self._wake_locked()
        return job.future

    def score(self, completions: Sequence[str], references: Sequence[str]) -> list[float]:
        """Blocking convenience: submit(...).result()."""
        return self.submit(completions, references).result()

    def warmup(self, timeout: float | None = None) -> bool:
        """Blocks until every worker has imported math-verify; True if they all did in time."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            gen = self._gen
            if gen is None or gen.is_ready():
                return True
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(0.02)

    def close(self) -> None:
        """Finishes queued work, then stops the workers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._wake_locked()
        self._thread.join()
        gen, self._gen = self._gen, None
        if gen is not None:
            try:
                gen.executor.shutdown(wait=True, cancel_futures=True)
            except Exception:
                gen.kill()
        self._closed = True

    def __enter__(self) -> "RewardPool":
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
        done, _ = cf.wait(
            list(self._in_flight) + [wake], timeout=timeout, return_when=cf.FIRST_COMPLETED
        )
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
        fn = _math_reward_unbounded if self.scorer is None else self.scorer
        job.put(idx, _bounded_call(fn, job.completions[idx], job.references[idx], self.timeout_s))

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
            unit = _Unit(items, isolated, budget, gen)
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

    def _effective_deadline(self, unit: _Unit) -> float:
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
                for (job, idx), s in zip(unit.items, scores):
                    job.put(idx, _as_reward(s))
                return
            exc = RuntimeError("malformed chunk result")
        self._blame(unit)
        if isinstance(exc, BrokenProcessPool):
            self._on_crash()

    def _blame(self, unit: _Unit) -> None:
        """An isolated item that failed scores 0.0; a chunk that failed is retried item by item."""
        if unit.isolated:
            for job, idx in unit.items:
                job.put(idx, 0.0)
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
                self._blame(self._in_flight.pop(fut))
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
            self._blame(unit)
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
            self._gen = _Generation(self._ctx, self.num_workers)
        except Exception:
            logger.exception("RewardPool: cannot rebuild worker pool; scoring inline")

    def _fail_everything(self) -> None:
        with self._lock:
            items = list(self._queue) + list(self._suspects)
            self._queue.clear()
            self._suspects.clear()
        for unit in self._in_flight.values():
            items.extend(unit.items)
        self._in_flight.clear()
        for job, idx in items:
            if not job.future.done():
                job.put(idx, 0.0)
