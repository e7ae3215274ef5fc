"""Critic-free group advantages: reward normalised over the n samples of one prompt."""

from __future__ import annotations

import numpy as np


def group_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    norm: str = "mean_std",
    std_eps: float = 1e-4,
    sample_ids: np.ndarray | None = None,
) -> np.ndarray:
    """Per-sequence advantage: r - mean(group), divided by (std(group) + eps) when norm == 'mean_std'.

    `sample_ids`: sequences of one group with the same sample id are branches of one episode (equal rewards):
    the group's mean and std are taken over its episodes, each counted once, and the branches share theirs.
    """
    if norm not in ("mean", "mean_std"):
        raise ValueError(f"advantage norm must be 'mean' or 'mean_std', got {norm!r}")
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    adv = np.zeros_like(rewards)
    for g in np.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx]
        once = r if sample_ids is None else r[np.unique(np.asarray(sample_ids)[idx], return_index=True)[1]]
        a = r - once.mean()
        if norm == "mean_std":
            a = a / (once.std() + std_eps)
        adv[idx] = a
    return adv.astype(np.float32)


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
    rewards: np.ndarray, group_ids: np.ndarray, norm: str, drop_uniform: bool, sample_ids: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(advantage, keep mask) of a training batch: what both training loops apply before a PPO step.

    With `drop_uniform` the mask leaves out groups without a learning signal (rank 0 rejects them when
    announced, so in the asynchronous runtime this only catches what reached a batch another way).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if len(rewards) == 0:
        return np.zeros(0, np.float32), np.zeros(0, bool)
    adv = group_advantages(rewards, group_ids, norm, sample_ids=sample_ids)
    keep = informative_groups(rewards, group_ids) if drop_uniform else np.ones(len(rewards), bool)
    return adv, keep
