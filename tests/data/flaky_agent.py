"""Agents that fail (tests/test_agent_failures.py): a flaky one, and one whose tool is always down."""

from __future__ import annotations

import asyncio
import os
import random

HELD_OUT = os.environ.get("FLAKY_AGENT_HELD_OUT", "").split(",")  # the evaluated held-out questions, the first hangs


async def agent(client, row: dict) -> str:
    """Half its training tries raise (a flaky tool); held out, it answers, except on one question, where it hangs
    past workflow.agent_timeout_s."""
    question = row["question"]
    if question == HELD_OUT[0]:
        await asyncio.sleep(3600)
    if question not in HELD_OUT and random.random() < 0.5:
        raise RuntimeError("the flaky tool failed")
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
    return reply.choices[0].message.content or ""


async def always_down(client, row: dict) -> str:
    raise ConnectionRefusedError("the tool's server is down")
