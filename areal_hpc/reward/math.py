"""Rule-based math reward: math-verify glue, with each call bounded in time by a SIGALRM alarm."""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import Callable

from areal_hpc.reward.values import RewardValueError, as_reward

__all__ = ["math_reward", "extract_last_boxed"]

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


@functools.lru_cache(maxsize=4096)
def _gold(reference: str) -> tuple:
    """The reference's parsed answer, once per reference: a group's n answers share it, and parsing is a
    third of a call's time. Parsed answers are immutable sympy values and strings, safe to share."""
    boxed_ref = extract_last_boxed(reference)
    gold_src = boxed_ref.strip() if boxed_ref is not None else reference
    if not gold_src or _too_deep(gold_src):
        return ()
    return tuple(_parse_bare(gold_src))


def _math_reward_unbounded(completion: str, reference: str) -> float:
    if not isinstance(completion, str) or not isinstance(reference, str):
        return 0.0
    completion = completion[-MAX_COMPLETION_CHARS:]
    reference = reference[-MAX_REFERENCE_CHARS:].strip()
    if not completion.strip() or not reference:
        return 0.0

    gold = _gold(reference)
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
    ok = verify(list(gold), pred, timeout_seconds=None, raise_on_error=False)
    return 1.0 if ok else 0.0


# --------------------------------------------------------------------------- time bounding


class _ScoreTimeout(BaseException):
    """Raised by our SIGALRM handler; BaseException so library `except Exception` cannot eat it."""


_ALARM_ACTIVE = False  # only touched from the main thread (signals only work there)


def _can_use_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread() and not _ALARM_ACTIVE


# How one scorer call ended: "ok", "timeout" (over its time limit) or "error" (it raised); counted per version.
OK, TIMEOUT, ERROR = "ok", "timeout", "error"


def bounded_call(fn: Callable, completion, reference, timeout_s: float | None) -> tuple[float, str, str, dict]:
    """(reward, how it ended, a one-line message, extras) of fn(completion, reference): a finite float and the
    other numbers a dict return carried, or 0.0 when fn raised, ran past timeout_s or returned something that
    is not a reward (an "error": None, NaN, a string, a dict without 'score'; reward/values.py).

    On the main thread the whole call is bounded by an ITIMER_REAL alarm (the caller's own
    alarm, if any, is restored afterwards). Off the main thread signals are unavailable, so
    the call is unbounded here and RewardPool's hard per-item deadline is the guard.
    """
    global _ALARM_ACTIVE
    try:
        if not timeout_s or timeout_s <= 0 or not _can_use_alarm():
            return _checked(fn(completion, reference))

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
                value = fn(completion, reference)
            finally:
                armed[0] = False
        except _ScoreTimeout:
            return 0.0, TIMEOUT, f"ran past reward.timeout_s ({timeout_s:g} s)", {}
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
    except RewardValueError as e:  # a weighted list's function returned something that is not a reward
        return 0.0, ERROR, str(e), {}
    except BaseException as e:
        # any scorer error, math-verify's BaseException-derived timeout...
        logger.debug("reward scorer failed", exc_info=True)
        return 0.0, ERROR, " ".join(f"raised {type(e).__name__}: {e}".split())[:300], {}
    return _checked(value)  # checked outside the alarm: a slow __float__ is not the scorer's time


def _checked(value) -> tuple[float, str, str, dict]:
    """bounded_call's answer for what fn returned: ok with its score and extras, or an error saying what it was."""
    try:
        score, extras = as_reward(value)
    except RewardValueError as e:
        return 0.0, ERROR, str(e), {}
    except Exception as e:  # an object of the user's whose repr or float() raises
        return 0.0, ERROR, f"returned a {type(value).__name__} that cannot be read ({type(e).__name__})", {}
    return score, OK, "", extras


def _bounded_call(fn: Scorer, completion: str, reference: str, timeout_s: float | None) -> float:
    """bounded_call's reward alone."""
    return bounded_call(fn, completion, reference, timeout_s)[0]


def math_reward(completion: str, reference: str, timeout_s: float = 5.0) -> float:
    """1.0 if the completion's final answer equals the reference mathematically, else 0.0.

    The final answer is the last ``\\boxed{...}`` when there is one, otherwise math-verify's
    extraction from the last MAX_COMPLETION_CHARS characters. Never raises. On the main thread
    the call is bounded by timeout_s (SIGALRM); elsewhere run it under RewardPool for a bound.
    """
    return _bounded_call(_math_reward_unbounded, completion, reference, timeout_s)
