"""Held-out accuracy: greedy decoding on held-out prompts, scored by the math reward."""

from __future__ import annotations

from areal_hpc.data import Problem
from areal_hpc.engines.base import generate
from areal_hpc.rollout import score_outputs
from areal_hpc.types import GenRequest


def heldout_accuracy(engine, tokenizer, reward_pool, problems: list[Problem], max_new_tokens: int) -> float:
    """Fraction of held-out problems answered correctly with greedy decoding (the engine batches them)."""
    if not problems:
        return float("nan")
    reqs = [GenRequest(f"{p.prompt_id}:0", p.prompt_ids, max_new_tokens, greedy=True) for p in problems]
    outs = generate(engine, reqs)
    return sum(score_outputs(reward_pool, tokenizer, outs, [p.answer for p in problems])) / len(problems)
