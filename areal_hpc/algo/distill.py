"""On-policy distillation's reverse KL: its sample on the student's own tokens, or exact over the vocabulary; pure."""

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


def full_kl_grad_(student_logsm: torch.Tensor, teacher_logsm: torch.Tensor, weight: torch.Tensor, rows: int = 64):
    """Per row KL(p_s || p_t) = sum_v p_s (log p_s - log p_t) from the two log-softmaxes of a chunk, and, written over
    `teacher_logsm` (no other chunk-sized buffer), weight x its gradient wrt the student's logits z (logsm = z - lse):
    d KL / dz = p_s * (log p_s - log p_t - KL). Returns (kl, that gradient); a few rows of p_s at a time."""
    kls = []
    for a in range(0, len(student_logsm), rows):
        s, t = student_logsm[a : a + rows], teacher_logsm[a : a + rows]
        p = s.exp()
        t.neg_().add_(s)  # log p_s - log p_t
        kl = (p * t).sum(-1)
        t.sub_(kl[:, None]).mul_(p).mul_(weight[a : a + rows, None].to(t.dtype))
        kls.append(kl)
    return (torch.cat(kls) if kls else student_logsm.new_zeros(0)), teacher_logsm
