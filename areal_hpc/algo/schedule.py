"""The learning rate at each policy version: a linear warm-up, then constant, cosine or linear decay."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_at(version: int, lr: float, schedule: str, warmup_versions: int, versions: int) -> float:
    """The learning rate of the update that trains version `version` (0-based) into version + 1.

    Warm-up: lr * (version + 1) / warmup_versions. After it, with p = (version - warmup) / (versions - warmup)
    in [0, 1): constant lr, cosine lr * (1 + cos(pi p)) / 2, linear lr * (1 - p). The last update (p < 1) never
    gets 0. A function of the version alone, so a resumed run goes on along the same curve.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"trainer.lr_schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if version < warmup_versions:
        return lr * (version + 1) / warmup_versions
    if schedule == "constant":
        return lr
    p = min((version - warmup_versions) / max(versions - warmup_versions, 1), 1.0)
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * p))
    return lr * (1.0 - p)
