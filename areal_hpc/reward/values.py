"""What a reward function may return: a finite number, or a dict with a finite `score` and other numbers to log."""

from __future__ import annotations

import math
import numbers

__all__ = ["RewardValueError", "as_reward", "finite_number", "ALLOWED"]

ALLOWED = "a reward returns a finite number, or a dict with a finite 'score' and other numbers to log"


class RewardValueError(ValueError):
    """A reward function returned something that is not a reward (scored 0 and counted as a reward error)."""


def finite_number(x) -> float | None:
    """x as a float when it is a real number (int, float, bool, a numpy scalar) and finite; else None.

    Text is never a number here: "1.0" from a reward is a bug to report, not a score to parse.
    """
    if not isinstance(x, numbers.Real):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def _shown(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def as_reward(x) -> tuple[float, dict[str, float]]:
    """(score, extras) of a reward function's return value; RewardValueError with one line (the value's type
    and repr) for anything else."""
    if isinstance(x, dict):
        if "score" not in x:
            raise RewardValueError(f"returned a dict without 'score': {_shown(x)}; {ALLOWED}")
        score = finite_number(x["score"])
        if score is None:
            got = x["score"]
            raise RewardValueError(f"returned 'score' {_shown(got)} ({type(got).__name__}); {ALLOWED}")
        extras = {}
        for k, v in x.items():
            if k == "score":
                continue
            num = finite_number(v)
            if not isinstance(k, str) or not k or num is None:
                raise RewardValueError(f"returned {k!r}: {_shown(v)} ({type(v).__name__}) beside 'score'; {ALLOWED}")
            extras[k] = num
        return score, extras
    score = finite_number(x)
    if score is None:
        raise RewardValueError(f"returned {_shown(x)} ({type(x).__name__}); {ALLOWED}")
    return score, {}
