"""Rule-based math reward: math-verify glue (each call bounded in time by reward/bounds.py)."""

from __future__ import annotations

import functools
import logging
import threading

from areal_hpc.reward.bounds import bounded_call

__all__ = ["math_reward", "extract_last_boxed"]

logger = logging.getLogger(__name__)

# Only the tail of a completion is parsed: the final answer lives there, and math-verify's
# regexes / LaTeX parser get slow on long or deeply nested input.
MAX_COMPLETION_CHARS = 2000
MAX_REFERENCE_CHARS = 1000
# Real answers never nest braces this deep; deeper input is adversarial and very slow to parse.
MAX_BRACE_DEPTH = 64

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


def math_reward(completion: str, reference: str, timeout_s: float = 5.0) -> float:
    """1.0 if the completion's final answer equals the reference mathematically, else 0.0.

    The final answer is the last ``\\boxed{...}`` when there is one, otherwise math-verify's
    extraction from the last MAX_COMPLETION_CHARS characters. Never raises. On the main thread
    the call is bounded by timeout_s (SIGALRM); elsewhere run it under RewardPool for a bound.
    """
    return bounded_call(_math_reward_unbounded, completion, reference, timeout_s)[0]


def warm_up() -> None:
    """Import math-verify and compile its regexes with a first parse: a worker's start-up, not its first call's
    time limit (only where the math reward is used)."""
    _math_reward_unbounded("\\boxed{\\frac{1}{2}}", "0.5")
