"""An example workflow, kept outside the package: workflow.fn=jobs/examples/two_turn.py:two_turn."""

from areal_hpc.workflow import Episode


async def two_turn(ep: Episode) -> float | None:
    """Answer; when the answer is not right, hear the question again as a user turn and answer again, for half the
    reward. (The tiny demo model's vocabulary has digits, +, =, \\boxed{ and } but no words: a feedback such as
    "no" would reach it as an unknown token. docs/workflows.md lists what it can read.)

    `ep.generate()` continues the transcript with the model's tokens (trained); `ep.append_message` adds the
    chat template's rendering of one message (not trained); `ep.reward` runs reward.fn on (text, ep.row).
    """
    first = await ep.generate()
    if first.finish_reason == "stop" and await ep.reward(first.text) == 1.0:
        return 1.0
    ep.append_message("user", ep.row["question"])
    second = await ep.generate()
    if second.finish_reason != "stop":
        return 0.0  # cut off by the length limit
    return 0.5 * await ep.reward(second.text)
