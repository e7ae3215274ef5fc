"""Tools of the built-in `tool` workflow: Python in the code reward's sandbox, or an in-process calculator."""

from __future__ import annotations

import ast
import functools
import operator
import re
import time

from areal_hpc.reward.sandbox import Limits, isolation, run_python
from areal_hpc.workflow.records import ToolResult

MAX_OUTPUT_CHARS = 1000  # what goes back to the model: a tool cannot flood the context


@functools.lru_cache(maxsize=4)
def _how(sandbox: str) -> str:
    # checked once per process; SandboxUnavailable (one line) if it cannot run
    return isolation(sandbox, "workflow.tool_sandbox").name


def sandboxed_python(code: str, wall_s: float, memory_mb: int, sandbox: str) -> ToolResult:
    """Run `code` with python3 under `sandbox`'s isolation (workflow.tool_sandbox): its output's tail, or what went
    wrong, as text."""
    r = run_python(code, Limits(wall_s=wall_s, memory_mb=memory_mb), _how(sandbox))
    text = r.output_tail.decode(errors="replace")[-MAX_OUTPUT_CHARS:]
    if r.timed_out:
        text += f"\nTimeoutError: the code ran past {wall_s:g} s"
    elif r.returncode != 0 and not text.strip():
        text = f"the code exited with status {r.returncode}"
    ok = r.returncode == 0 and not r.timed_out
    return ToolResult(text=text, ok=ok, timed_out=r.timed_out, seconds=r.wall_s)


_PRINT = re.compile(r"^print\((.*)\)$")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
MAX_DIGITS = 100  # a calculator answer longer than this is refused: no expression may eat the generator's time


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Mult) and abs(a) > 1 and abs(b) > 1 and _digits(a) + _digits(b) > MAX_DIGITS:
            raise ValueError("the result is too large")
        return _OPS[type(node.op)](a, b)
    what = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node).__name__
    raise ValueError(f"{what} is not allowed in the calculator")


def _digits(x) -> int:
    return len(str(int(abs(x))))


def calculator(code: str) -> ToolResult:
    """The `calculator` tool: each line is `print(<arithmetic>)` (its value is printed) or bare arithmetic, with
    + - * / // % and parentheses; evaluated in this process (no sandbox needed: nothing else is run)."""
    t0 = time.monotonic()
    out = []
    try:
        for line in (ln.strip() for ln in code.splitlines()):
            if not line:
                continue
            m = _PRINT.match(line)
            expr = re.sub(r"\b0+(\d)", r"\1", m.group(1) if m else line)  # 07 is seven, as written in prompts
            value = _value(ast.parse(expr, mode="eval").body)
            if m:
                out.append(str(value))
        return ToolResult("\n".join(out), True, False, time.monotonic() - t0)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return ToolResult(f"{type(e).__name__}: {e}", False, False, time.monotonic() - t0)
