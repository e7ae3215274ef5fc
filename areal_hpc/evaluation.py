"""Held-out accuracy: greedy decoding on held-out prompts, scored by the math reward."""

from __future__ import annotations

from areal_hpc.data import Problem
from areal_hpc.rollout import score_outputs
from areal_hpc.types import GenRequest


def heldout_accuracy(engine, tokenizer, reward_pool, problems: list[Problem], max_new_tokens: int, batch_size: int = 512) -> float:
    """Fraction of held-out problems answered correctly with greedy decoding."""
    if not problems:
        return float("nan")
    correct = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        reqs = [GenRequest(f"{p.prompt_id}:0", tokenizer.encode(p.prompt), max_new_tokens) for p in chunk]
        outs = engine.generate(reqs, greedy=True)
        correct += sum(score_outputs(reward_pool, tokenizer, outs, [p.answer for p in chunk]))
    return correct / len(problems)
