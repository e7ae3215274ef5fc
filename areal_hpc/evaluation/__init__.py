"""Held-out evaluation: k episodes (or one greedy) per problem of the run's workflow, scored; accuracy (an episode
is correct when its reward reaches logging.eval_threshold), avg@k, pass@k, and the mean reward beside them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from areal_hpc.data import Problem


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased chance that at least one of k answers drawn from n (c of them correct) is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def heldout_figures(rewards: list[float], threshold: float) -> dict:
    """A held-out evaluation's two figures, as metrics.csv names them: the accuracy (the share of episodes whose
    reward is >= threshold) and the mean reward (partial credit counts there, never in the accuracy)."""
    if not rewards:
        return {"heldout_acc": math.nan, "heldout_reward_mean": math.nan}
    return {
        "heldout_acc": sum(r >= threshold for r in rewards) / len(rewards),
        "heldout_reward_mean": sum(rewards) / len(rewards),
    }


def report_ks(n: int) -> list[int]:
    """The k of pass@k reported for n samples: powers of two up to n, and n itself."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


@dataclass
class EvalResult:
    """avg@k is pass@1 (accuracy: reward >= threshold) estimated from k samples per problem; its standard error
    is over problems. reward_mean is the mean episode reward, partial credit included."""

    n_problems: int
    n_samples: int
    avg_at_k: float
    avg_at_k_stderr: float
    pass_at_k: dict[int, float]
    mean_response_tokens: float
    truncated_share: float  # answers cut off by max_new_tokens (no stop token), scored 0
    rewards: list[list[float]] = field(repr=False)  # per problem, per sample
    tool_share: float = 0.0  # episodes that called a tool (the `tool` workflow, or one of your own)
    reward_mean: float = 0.0  # mean episode reward (avg@k counts an episode only when its reward >= threshold)
    threshold: float = 1.0  # logging.eval_threshold: the reward at which an answer counts as correct

    def as_dict(self) -> dict:
        d = asdict(self)
        d["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return d


def summarize(
    rewards: list[list[float]], lengths: list[int], truncated: list[bool], tool_users: int = 0, threshold: float = 1.0
) -> EvalResult:
    """The figures papers report from per-problem, per-sample rewards (correct: reward >= threshold)."""
    n = len(rewards[0])
    correct = [sum(1 for x in r if x >= threshold) for r in rewards]
    per_problem = [c / n for c in correct]
    mean = sum(per_problem) / len(per_problem)
    var = sum((x - mean) ** 2 for x in per_problem) / max(1, len(per_problem) - 1)
    return EvalResult(
        n_problems=len(rewards),
        n_samples=n,
        avg_at_k=mean,
        avg_at_k_stderr=math.sqrt(var / len(per_problem)),
        pass_at_k={k: sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in report_ks(n)},
        mean_response_tokens=sum(lengths) / len(lengths),
        truncated_share=sum(truncated) / len(truncated),
        rewards=rewards,
        tool_share=tool_users / len(truncated),
        reward_mean=sum(map(sum, rewards)) / (n * len(rewards)),
        threshold=threshold,
    )


def evaluate(
    engine,
    tokenizer,
    reward_pool,
    problems: list[Problem],
    settings,
    n_samples: int = 1,
    greedy=True,
    workflow=None,
    threshold: float = 1.0,
) -> EvalResult:
    """n_samples episodes of the workflow per problem (greedy: one, at temperature 0; else at the engine's
    temperature); an episode's reward is its score (a rejected or failed one scores 0: pass@k needs every sample;
    so do the sync loop's held-out figures, heldout_evaluation below, while an asynchronous run's generators leave
    failed ones out, evaluation/heldout.py), correct when >= threshold.
    `settings`: the RunnerSettings (workflow_settings) of the run; `workflow` defaults to single_turn."""
    from areal_hpc.workflow import single_turn
    from areal_hpc.workflow.batch import EpisodeStart, run_episodes

    if not problems:
        raise ValueError("no problems to evaluate")
    if greedy and n_samples != 1:
        raise ValueError(f"greedy evaluation gives one answer per problem, asked for {n_samples}")
    starts = [
        EpisodeStart(f"{i}:{s}", p.row, p.prompt_ids, greedy) for i, p in enumerate(problems) for s in range(n_samples)
    ]
    eps = run_episodes(engine, workflow or single_turn, tokenizer, reward_pool, settings, starts, retry=False)
    scores = [e.reward or 0.0 for e in eps]
    rewards = [scores[i * n_samples : (i + 1) * n_samples] for i in range(len(problems))]
    lengths = [sum(len(seg.ids) for seg in e.sampled) for e in eps]
    tool_users = sum(e.stats.tool_calls > 0 for e in eps)
    return summarize(rewards, lengths, [e.finish_reason == "length" for e in eps], tool_users, threshold)


def heldout_evaluation(
    engine,
    tokenizer,
    reward_pool,
    problems: list[Problem],
    settings,
    n_samples: int = 1,
    greedy=True,
    workflow=None,
    threshold: float = 1.0,
) -> dict:
    """Held-out figures as a run logs them (`heldout_figures`): greedy, or n_samples at the engine's temperature."""
    if not problems:
        return heldout_figures([], threshold)
    res = evaluate(engine, tokenizer, reward_pool, problems, settings, n_samples, greedy, workflow, threshold)
    return heldout_figures([x for r in res.rewards for x in r], threshold)
