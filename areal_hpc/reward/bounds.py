"""How one scorer call is bounded and how it ended: its time limit (a SIGALRM alarm), its status, its value read."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from areal_hpc.reward.values import RewardValueError, as_reward

logger = logging.getLogger(__name__)

Scorer = Callable[[str, str], float]


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
