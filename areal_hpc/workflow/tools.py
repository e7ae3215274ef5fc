"""Tool calls of the built-in `tool` workflow: Python run in the code reward's sandbox, its output as text."""

from __future__ import annotations

import functools

from areal_hpc.reward.sandbox import Limits, isolation, run_python
from areal_hpc.workflow.episode import ToolResult

MAX_OUTPUT_CHARS = 1000  # what goes back to the model: a tool cannot flood the context


@functools.lru_cache(maxsize=4)
def _how(sandbox: str) -> str:
    return isolation(sandbox).name  # checked once per process; SandboxUnavailable (one line) if it cannot run


def sandboxed_python(code: str, wall_s: float, memory_mb: int, sandbox: str) -> ToolResult:
    """Run `code` with python3 under reward.sandbox's isolation: its output's tail, or what went wrong, as text."""
    r = run_python(code, Limits(wall_s=wall_s, memory_mb=memory_mb), _how(sandbox))
    text = r.output_tail.decode(errors="replace")[-MAX_OUTPUT_CHARS:]
    if r.timed_out:
        text += f"\nTimeoutError: the code ran past {wall_s:g} s"
    elif r.returncode != 0 and not text.strip():
        text = f"the code exited with status {r.returncode}"
    ok = r.returncode == 0 and not r.timed_out
    return ToolResult(text=text, ok=ok, timed_out=r.timed_out, seconds=r.wall_s)
