"""A calculator agent written with the `openai` client alone: workflow.agent=jobs/examples/calculator_agent.py:agent."""

from __future__ import annotations

import json
import math
import re

import openai

MODEL = "policy"  # the endpoint serves the one policy being trained, whatever the name
MAX_CALLS = 3  # model calls per episode: room for a tool call or two, then the answer
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "The value of an arithmetic expression: whole numbers joined by +, - and *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*34"}},
            "required": ["expression"],
        },
    },
}


def calculate(expression: str) -> str:
    """The value of digits joined by + - * (products first), or an error text the model reads as the result.
    No eval(): the model's text is never run as code."""
    expr = re.sub(r"\s+", "", expression)
    if len(expr) > 64 or not re.fullmatch(r"\d+([-+*]\d+)*", expr):
        return "error: not digits joined by + - *"
    terms = re.findall(r"([-+]?)([\d*]+)", expr)  # a sign, then a product of numbers
    return str(sum((-1 if sign == "-" else 1) * math.prod(map(int, term.split("*"))) for sign, term in terms))


def run_tool(call) -> str:
    """One tool call's result: the calculator's, or an error text for anything else the model wrote."""
    if call.function.name != "calculator":
        return f"error: no tool {call.function.name!r}"
    try:
        return calculate(str(json.loads(call.function.arguments)["expression"]))
    except (ValueError, KeyError, TypeError):  # arguments that are not {"expression": ...} JSON
        return "error: arguments must be {'expression': '...'}"


async def agent(client: openai.AsyncOpenAI, row: dict) -> str:
    """Ask the question with the calculator on offer; run every tool call and ask again, until the model answers
    in words (its final answer, which the run scores) or has been asked MAX_CALLS times."""
    messages = [{"role": "user", "content": row["question"]}]
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        # the history grows by the assistant's turn as it came back, then one tool result per call
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return ""  # still calling tools after MAX_CALLS turns: no answer
