"""Code reward: the completion's last fenced Python block run against a task's tests in the sandbox."""

from __future__ import annotations

import re
import secrets

from areal_hpc.reward.sandbox import Limits, isolation, run_python

__all__ = ["code_reward", "extract_last_python_block"]

# Bigger than any honest answer to a code task; refusing early keeps a degenerate completion cheap.
MAX_CODE_CHARS = 100_000
MAX_TESTS_CHARS = 1_000_000

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.S | re.I)


def extract_last_python_block(text: str) -> str | None:
    """The body of the last closed ```python (or ```py, ```python3) block, else None."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None


# The candidate runs first, then the tests, in one namespace (as the common code-RL datasets' asserts expect).
# Success is the exit code 0 AND a token printed only after the tests passed: code that exits early
# (sys.exit(0), os._exit(0)) or prints a fake success line scores 0. The token is in this process's memory,
# so only code that searches the interpreter's own objects for it could forge it.
_RUNNER = """
def _areal_run(code, tests, token, run=exec, build=compile):
    # exec, compile and the exits are bound before the candidate runs: it may replace the builtins and os
    import os, sys
    write, leave = os.write, os._exit
    ns = {{"__name__": "solution", "__builtins__": __builtins__}}
    try:
        run(build(code, "solution.py", "exec"), ns)
        run(build(tests, "tests.py", "exec"), ns)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        try:
            import traceback
            traceback.print_exc(limit=3)
            sys.stderr.flush()
        finally:
            leave(1)
    write(1, b"\\n" + token)
    leave(0)
_areal_run({code!r}, {tests!r}, {token!r})
"""


def _run(code: str, tests: str, how: str, limits: Limits) -> float:
    token = secrets.token_hex(16).encode()
    result = run_python(_RUNNER.format(code=code, tests=tests, token=token), limits, how)
    ok = result.returncode == 0 and not result.timed_out and result.output_tail.endswith(b"\n" + token)
    return 1.0 if ok else 0.0


def _score(completion, tests, how: str, limits: Limits) -> float:
    if not isinstance(completion, str) or not isinstance(tests, str) or not tests.strip():
        return 0.0
    code = extract_last_python_block(completion)
    if code is None or not code.strip() or len(code) > MAX_CODE_CHARS or len(tests) > MAX_TESTS_CHARS:
        return 0.0
    return _run(code, tests, how, limits)


def code_reward(
    completion: str, tests: str, timeout_s: float = 5.0, memory_mb: int = 1024, sandbox: str = "auto"
) -> float:
    """1.0 if the completion's last fenced Python block passes the tests (Python asserts), else 0.0.

    Runs in the sandbox (`sandbox.py`) under `sandbox` (auto | bwrap | none, as reward.sandbox) with a wall
    timeout of timeout_s. Bad input scores 0.0; SandboxUnavailable if the asked isolation cannot run here.
    """
    how = isolation(sandbox).name
    return _score(completion, tests, how, Limits(wall_s=float(timeout_s), memory_mb=int(memory_mb)))
