"""On-policy distillation's per-token term: the reverse KL's sample on the student's own tokens, pure (no I/O)."""

from __future__ import annotations

import torch


def distill_term(
    teacher_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, coef: float, baseline: float = 0.0
) -> torch.Tensor:
    """Per token, coef x (log p_teacher - log p_behaviour - baseline) on the loss mask, 0 elsewhere; added to the
    advantage. `baseline` is the batch's mean of the gap (batch_baseline): a constant, so the policy gradient keeps
    its expectation, while the gap's mean (minus the reverse KL, always < 0) no longer pushes every sampled token
    down at once.

    The behaviour logprobs are those of the student weights that sampled the token, so the mean over tokens of
    the negated term / coef estimates KL(student || teacher) (reverse KL, k1) on the student's own samples.
    Detached: an advantage, not a loss (the policy-gradient objective carries it as it carries the task's)."""
    m = mask.to(torch.float32)
    gap = (teacher_logp.detach().float() - behav_logp.detach().float() - baseline) * m
    return coef * torch.where(m > 0, gap, torch.zeros_like(gap))


def reverse_kl_sum(teacher_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Sum over the loss tokens of log p_behaviour - log p_teacher: distill_kl's numerator (its tokens: mask.sum())."""
    m = mask.to(torch.float32) > 0
    return float((behav_logp.float() - teacher_logp.float())[m].sum())


def baseline_sums(teacher_all: list, trajectories) -> tuple[float, float]:
    """(sum of log p_teacher - log p_behaviour over the loss tokens, their count): the batch baseline's parts,
    added over trainers before the division."""
    total, n = 0.0, 0.0
    for lp, t in zip(teacher_all, trajectories, strict=True):
        m = torch.as_tensor(t.loss_mask) > 0
        total += float((torch.as_tensor(lp).float() - torch.as_tensor(t.behav_logprobs).float())[m].sum())
        n += float(m.sum())
    return total, n
