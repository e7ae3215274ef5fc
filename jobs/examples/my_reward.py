"""An example reward function, outside the package: reward.fn=jobs/examples/my_reward.py:reward."""

import re

BOXED = re.compile(r"\\boxed\{([0-9]+)\}")


def reward(completion: str, row: dict) -> float:
    """1.0 when the last \\boxed{} holds the row's answer, 0.1 for a boxed wrong number, else 0.0.

    `row` is the dataset row with all its fields (here `question` and `answer`). It runs in the reward worker
    processes under reward.timeout_s: a call that hangs or raises scores 0 and is counted.
    """
    found = BOXED.findall(completion)
    if not found:
        return 0.0
    return 1.0 if found[-1] == str(row["answer"]) else 0.1
