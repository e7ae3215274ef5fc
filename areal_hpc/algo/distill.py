"""On-policy distillation's per-token term: the reverse KL's sample on the student's own tokens, pure (no I/O)."""

from __future__ import annotations

import torch


def distill_term(
    teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor, coef: float, baseline: float = 0.0
) -> torch.Tensor:
    """Per token, coef x (log p_teacher - log p_student - baseline) on the loss mask, 0 elsewhere; added to the
    advantage. `baseline` is the batch's mean of the gap (baseline_sums): a constant, so the policy gradient keeps
    its expectation, while the gap's mean (minus the reverse KL, always < 0) no longer pushes every sampled token
    down at once.

    The student's logprobs are the trained weights' (the proximal recompute) or, without one, the sampler's, so
    the negated gap is the k1 sample of KL(student || teacher) (reverse KL) on the student's own tokens.
    Detached: an advantage, not a loss (the policy-gradient objective carries it as it carries the task's)."""
    gap = teacher_logp.detach().float() - student_logp.detach().float() - baseline
    return coef * torch.where(mask > 0, gap, torch.zeros_like(gap))


def baseline_sums(teacher_all: list, student_all: list, masks: list) -> tuple[float, float]:
    """(sum of log p_teacher - log p_student over the loss tokens, their count): the batch baseline's parts, added
    over trainers before the division; a share's own are its distill_kl (negated, over the count)."""
    total, n = 0.0, 0.0
    for lp, student, mask in zip(teacher_all, student_all, masks, strict=True):
        m = torch.as_tensor(mask) > 0
        total += float((torch.as_tensor(lp).float().cpu() - torch.as_tensor(student).float().cpu())[m].sum())
        n += float(m.sum())
    return total, n
