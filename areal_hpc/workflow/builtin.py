"""The built-in workflows (workflow.fn by name): single_turn, multi_turn (feedback and retry), tool (Python)."""

from __future__ import annotations

import re

from areal_hpc.workflow.episode import Episode

# tool: a code block the model closes ends its generation; the output goes back as a block of its own
CODE_CLOSE = "```\n"
_CODE = re.compile(r"```python\n(.*?)```\n$", re.S)


async def single_turn(ep: Episode) -> float:
    """One answer, scored by the reward function; an answer cut off by the length limit scores 0."""
    answer = await ep.generate()
    if answer.finish_reason != "stop":
        return 0.0
    return await ep.reward(answer.text)


async def multi_turn(ep: Episode) -> float:
    """Up to workflow.max_turns answers: a wrong one gets workflow.feedback as a user turn and another try. A
    right answer at turn k (from 0) earns its reward times workflow.turn_discount ** k."""
    wc = ep.config
    for turn in range(wc.max_turns):
        answer = await ep.generate()
        if answer.finish_reason == "stop":
            r = await ep.reward(answer.text)
            if r > 0:
                return r * wc.turn_discount**turn
        if turn + 1 < wc.max_turns:
            ep.append_message("user", wc.feedback)
    return 0.0


def tool_observation(text: str) -> str:
    """How a tool's output is shown to the model: a block of its own after the code."""
    return "```output\n" + text.rstrip("\n") + "\n```\n"


async def tool(ep: Episode) -> float:
    """Tool-integrated reasoning: when the model closes a ```python block, generation stops, the block runs in
    the sandbox (workflow.tool=calculator: an in-process calculator) and its output (or error, or time-out) is
    appended as an observation, not trained; up to workflow.max_tool_calls times. The final answer is scored
    by the reward function."""
    wc = ep.config
    text = ""
    for _ in range(wc.max_tool_calls + 1):
        answer = await ep.generate(stop=[CODE_CLOSE] if ep.stats.tool_calls < wc.max_tool_calls else None)
        text += answer.text
        block = _CODE.search(answer.text)
        if answer.finish_reason != "stop" or block is None or not answer.text.endswith(CODE_CLOSE):
            break  # EOS, the length limit, or a stop that closed no code block
        code = block.group(1)
        result = ep.calculate(code) if wc.tool == "calculator" else await ep.run_python(code)
        text += ep.decode(ep.append_text(tool_observation(result.text)))
    if ep.last_finish != "stop":
        return 0.0
    return await ep.reward(text)


BUILTIN = {"single_turn": single_turn, "multi_turn": multi_turn, "tool": tool}
# built-ins that live with their feature, by import path (resolved on use: they bring their feature's imports
# along, and their package stands above this one): the workflow and the start-up check of its settings
WITH_THEIR_FEATURE = {"agent": ("areal_hpc.agents.workflow:agent", "areal_hpc.agents.workflow:check_agent_config")}
