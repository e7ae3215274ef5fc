"""Workflows of benchmarks/workflows.py: a tool call between two answers, awaited or blocking the generator's loop."""

from __future__ import annotations

import asyncio
import time

from areal_hpc.workflow import Episode


async def async_tool(ep: Episode) -> float:
    """Answer, a tool call of workflow.args.tool_s seconds (awaited: other episodes keep the engine full), answer."""
    await ep.generate()
    await asyncio.sleep(float(ep.args.get("tool_s", 0.2)))
    ep.append_text("=")
    answer = await ep.generate()
    return 0.0 if answer.finish_reason != "stop" else await ep.reward(answer.text)


async def blocking_tool(ep: Episode) -> float:
    """The same episode with the tool run inline: the generator's loop, and so its engine, waits for it."""
    await ep.generate()
    time.sleep(float(ep.args.get("tool_s", 0.2)))
    ep.append_text("=")
    answer = await ep.generate()
    return 0.0 if answer.finish_reason != "stop" else await ep.reward(answer.text)
