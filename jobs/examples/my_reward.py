"""Example reward functions, outside the package: reward.fn=jobs/examples/my_reward.py:reward (or a list)."""

import re

BOXED = re.compile(r"\\boxed\{([0-9]+)\}")


def reward(completion: str, row: dict, wrong: float = 0.1) -> float:
    """1.0 when the last \\boxed{} holds the row's answer, `wrong` for a boxed wrong number, else 0.0.

    `row` is the dataset row with all its fields (here `question` and `answer`); `wrong` can come from the
    config (reward.args). It runs in the reward worker processes under reward.timeout_s: a call that hangs,
    raises or returns anything but a finite number (or a dict with a 'score') scores 0 and is counted.
    """
    found = BOXED.findall(completion)
    if not found:
        return 0.0
    return 1.0 if found[-1] == str(row["answer"]) else wrong


def form(completion: str, row: dict) -> dict:
    """1.0 for an answer in the form `reward` reads (a \\boxed{} number); beside the score, a number to log:
    the answer's length in characters (metrics.csv: reward/form/length in a list, reward/length alone)."""
    return {"score": float(BOXED.search(completion) is not None), "length": len(completion)}
