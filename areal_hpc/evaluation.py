"""Held-out evaluation: k samples (or one greedy answer) per problem, scored by the reward; avg@k, pass@k."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from areal_hpc.data import Problem
from areal_hpc.engines.base import generate
from areal_hpc.rollout import score_outputs
from areal_hpc.types import GenRequest, SampleId


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased chance that at least one of k answers drawn from n (c of them correct) is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def report_ks(n: int) -> list[int]:
    """The k of pass@k reported for n samples: powers of two up to n, and n itself."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


@dataclass
class EvalResult:
    """avg@k is pass@1 estimated from k samples per problem; its standard error is over problems."""

    n_problems: int
    n_samples: int
    avg_at_k: float
    avg_at_k_stderr: float
    pass_at_k: dict[int, float]
    mean_response_tokens: float
    truncated_share: float  # answers cut off by max_new_tokens (no stop token), scored 0
    rewards: list[list[float]] = field(repr=False)  # per problem, per sample

    def as_dict(self) -> dict:
        d = asdict(self)
        d["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return d


def summarize(rewards: list[list[float]], lengths: list[int], truncated: list[bool]) -> EvalResult:
    """The figures papers report from per-problem, per-sample rewards (1 = correct)."""
    n = len(rewards[0])
    per_problem = [sum(r) / n for r in rewards]
    mean = sum(per_problem) / len(per_problem)
    var = sum((x - mean) ** 2 for x in per_problem) / max(1, len(per_problem) - 1)
    correct = [sum(1 for x in r if x > 0.5) for r in rewards]
    return EvalResult(
        n_problems=len(rewards),
        n_samples=n,
        avg_at_k=mean,
        avg_at_k_stderr=math.sqrt(var / len(per_problem)),
        pass_at_k={k: sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in report_ks(n)},
        mean_response_tokens=sum(lengths) / len(lengths),
        truncated_share=sum(truncated) / len(truncated),
        rewards=rewards,
    )


def evaluate(
    engine, tokenizer, reward_pool, problems: list[Problem], max_new_tokens: int, n_samples: int = 1, greedy=True
) -> EvalResult:
    """n_samples answers per problem (greedy: one, at temperature 0; else at the engine's temperature)."""
    if not problems:
        raise ValueError("no problems to evaluate")
    if greedy and n_samples != 1:
        raise ValueError(f"greedy evaluation gives one answer per problem, asked for {n_samples}")
    reqs = [
        GenRequest(str(SampleId(i, s)), p.prompt_ids, max_new_tokens, greedy=greedy)
        for i, p in enumerate(problems)
        for s in range(n_samples)
    ]
    outs = generate(engine, reqs)
    scores = score_outputs(reward_pool, tokenizer, outs, [p.answer for p in problems for _ in range(n_samples)])
    rewards = [scores[i * n_samples : (i + 1) * n_samples] for i in range(len(problems))]
    return summarize(rewards, [len(o.output_ids) for o in outs], [o.finish_reason == "length" for o in outs])


def heldout_accuracy(
    engine, tokenizer, reward_pool, problems: list[Problem], max_new_tokens: int, n_samples: int = 1, greedy=True
) -> float:
    """Held-out accuracy as a run logs it: greedy, or avg@k over n_samples at the engine's temperature."""
    if not problems:
        return float("nan")
    return evaluate(engine, tokenizer, reward_pool, problems, max_new_tokens, n_samples, greedy).avg_at_k
