"""Critic-free group advantages: reward normalised over the n samples of one prompt."""

from __future__ import annotations

import numpy as np

ADV_STDS = ("unbiased", "population")


def _episodes_once(values: np.ndarray, idx: np.ndarray, sample_ids: np.ndarray | None) -> np.ndarray:
    """The values of sequences `idx`, each episode counted once (its branches share one value)."""
    r = values[idx]
    return r if sample_ids is None else r[np.unique(np.asarray(sample_ids)[idx], return_index=True)[1]]


def group_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    norm: str = "mean_std",
    std_eps: float = 1e-4,
    sample_ids: np.ndarray | None = None,
    scope: str = "group",
    sum_across_trainers=None,
    std: str = "unbiased",
) -> np.ndarray:
    """Per-sequence advantage: r - mean, divided by (std + eps) when norm == 'mean_std'; norm == 'none': r.

    scope == 'group': the mean and std of the prompt's group (GRPO); 'batch': of the whole batch, over every
    trainer when `sum_across_trainers` (a collective summing a vector over trainers) is given.
    `sample_ids`: sequences of one group with the same sample id are branches of one episode (equal rewards):
    statistics are taken over episodes, each counted once, and the branches share their advantage.
    `std`: 'unbiased' divides the squares by n - 1 (AReaL, verl, TRL), 'population' by n; n < 2 gives std 0
    (a lone sample's advantage is then 0).
    """
    if norm not in ("none", "mean", "mean_std"):
        raise ValueError(f"advantage norm must be 'none', 'mean' or 'mean_std', got {norm!r}")
    if std not in ADV_STDS:
        raise ValueError(f"ppo.adv_std must be one of {', '.join(ADV_STDS)}; got {std!r}")
    if scope not in ("group", "batch"):
        raise ValueError(f"advantage scope must be 'group' or 'batch', got {scope!r}")
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    if norm == "none":
        return rewards.astype(np.float32)
    if scope == "batch":
        once = np.concatenate(
            [_episodes_once(rewards, group_ids == g, sample_ids) for g in np.unique(group_ids)] or [np.zeros(0)]
        )
        sums = np.array([len(once), once.sum(), (once**2).sum()], dtype=np.float64)
        n, s1, s2 = sum_across_trainers(sums) if sum_across_trainers is not None else sums
        mean = s1 / max(n, 1.0)
        var = max(s2 / max(n, 1.0) - mean**2, 0.0) * _bessel(n, std)
        adv = rewards - mean
        return (adv / (np.sqrt(var) + std_eps) if norm == "mean_std" else adv).astype(np.float32)
    adv = np.zeros_like(rewards)
    for g in np.unique(group_ids):
        idx = group_ids == g
        once = _episodes_once(rewards, idx, sample_ids)
        a = rewards[idx] - once.mean()
        if norm == "mean_std":
            a = a / (np.sqrt(once.var() * _bessel(len(once), std)) + std_eps)
        adv[idx] = a
    return adv.astype(np.float32)


def _bessel(n: float, std: str) -> float:
    """What the population variance of n values is multiplied by: n / (n - 1) for the unbiased one, 0 if n < 2."""
    if n < 2:
        return 0.0
    return n / (n - 1.0) if std == "unbiased" else 1.0


def informative_groups(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Boolean mask over sequences: True where the group's rewards are not all equal.

    Dynamic sampling drops groups whose success rate is 0 or 1: their advantages are all zero and
    they only dilute the token normalisation.
    """
    rewards = np.asarray(rewards)
    group_ids = np.asarray(group_ids)
    keep = np.zeros(len(rewards), dtype=bool)
    for g in np.unique(group_ids):
        idx = group_ids == g
        keep[idx] = rewards[idx].max() > rewards[idx].min()
    return keep


def batch_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    norm: str,
    drop_uniform: bool,
    sample_ids: np.ndarray | None = None,
    scope: str = "group",
    sum_across_trainers=None,
    std: str = "unbiased",
) -> tuple[np.ndarray, np.ndarray]:
    """(advantage, keep mask) of a training batch: what both training loops apply before a PPO step.

    With `drop_uniform` the mask leaves out groups without a learning signal (rank 0 rejects them when
    announced, so in the asynchronous runtime this only catches what reached a batch another way).
    With scope == 'batch' every trainer must call this (its statistics are summed over trainers).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if len(rewards) == 0 and scope == "group":
        return np.zeros(0, np.float32), np.zeros(0, bool)
    adv = group_advantages(
        rewards,
        group_ids,
        norm,
        sample_ids=sample_ids,
        scope=scope,
        sum_across_trainers=sum_across_trainers,
        std=std,
    )
    keep = informative_groups(rewards, group_ids) if drop_uniform else np.ones(len(rewards), bool)
    return adv, keep


def longest_answer(loss_mask: np.ndarray) -> int:
    """The longest run of trained tokens: an episode's longest model call (tool output and prompts are untrained)."""
    m = np.concatenate([[0], np.asarray(loss_mask, dtype=np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))
    return int((edges[1::2] - edges[::2]).max()) if len(edges) else 0


def overlong_penalty(lengths: np.ndarray, max_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment (a reward term, <= 0): 0 up to max_tokens - buffer tokens, then falling
    linearly to -penalty at max_tokens. buffer == 0: none."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if buffer <= 0:
        return np.zeros(len(lengths))
    start = max_tokens - buffer
    return -penalty * np.clip((lengths - start) / buffer, 0.0, 1.0)
