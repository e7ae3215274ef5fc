"""The calculator agent of calculator_agent.py, written once more with the OpenAI Agents SDK (chat completions)."""

import re

import openai
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)

# The SDK's tracing exports spans to api.openai.com by default; the run must never reach outside the machine.
set_tracing_disabled(True)

_EXPRESSION = re.compile(r"\s*\d+(\s*[-+*]\s*\d+)*\s*")
_TOKEN = re.compile(r"\d+|[-+*]")


def evaluate(expression: str) -> int:
    """Digits joined by + - * with the usual precedence; anything else raises ValueError."""
    if not _EXPRESSION.fullmatch(expression):
        raise ValueError("only digits and + - * are allowed")
    tokens = _TOKEN.findall(expression)
    total, term, sign = 0, int(tokens[0]), 1
    for op, number in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            term *= int(number)
        else:
            total += sign * term
            term, sign = int(number), 1 if op == "+" else -1
    return total + sign * term


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of digits and + - *.

    Args:
        expression: for example 12*34
    """
    try:
        return str(evaluate(expression))
    except ValueError as error:
        return f"error: {error}"


async def agent(client: openai.AsyncOpenAI, row: dict) -> str:
    """Ask the question as the only user message (no instructions: the tiny model cannot read a system prompt)."""
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    # Empty instructions: the SDK then sends no system message at all.
    calc_agent = Agent(name="calculator", model=model, tools=[calculator], model_settings=ModelSettings())
    try:
        result = await Runner.run(calc_agent, row["question"], max_turns=3, run_config=RunConfig(tracing_disabled=True))
    except MaxTurnsExceeded:
        return ""  # still calling the tool after 3 turns: no answer, scored as wrong rather than a crash
    return str(result.final_output)
