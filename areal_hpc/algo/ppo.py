"""Decoupled (staleness-aware) PPO loss and the loglinear proximal-policy approximation."""

from __future__ import annotations

import torch


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    behav_imp_weight_cap: float | None = None,
    total_loss_tokens: float | int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AReaL's decoupled PPO objective on flat per-token tensors.

    u = exp(logp - prox_logp) is clipped around the proximal policy; w = exp(prox_logp - behav_logp)
    corrects for the behaviour policy that sampled the tokens and carries no gradient. Tokens whose
    w exceeds `behav_imp_weight_cap` are dropped from the loss. The summed loss is divided by
    `total_loss_tokens` (the loss-token count of the whole batch across all trainers) when given,
    else by this call's mask sum, so gradients add up correctly across micro-batches and ranks.
    """
    mask = loss_mask.to(logp.dtype)
    prox_logp = prox_logp.detach()
    behav_logp = behav_logp.detach()
    advantages = advantages.detach().to(logp.dtype)

    behav_w = torch.exp(prox_logp - behav_logp)
    if behav_imp_weight_cap is not None:
        capped = (behav_w > behav_imp_weight_cap).to(mask.dtype) * mask
        mask = mask * (behav_w <= behav_imp_weight_cap).to(mask.dtype)
    else:
        capped = torch.zeros_like(mask)
    # Masked and capped tokens are zeroed *before* anything multiplies: a where() around the product alone
    # keeps the forward finite, but its backward still meets 0 * inf (an overflowing ratio or weight) = NaN,
    # and one NaN gradient spoils every weight that is then published.
    keep = mask > 0
    zero = torch.zeros_like(logp)
    behav_w = torch.where(keep, behav_w, zero)
    ratio = torch.exp(torch.where(keep, logp - prox_logp, zero))
    surr1 = ratio * advantages
    surr2 = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip) * advantages
    per_token = -behav_w * torch.minimum(surr1, surr2)

    denom = float(total_loss_tokens) if total_loss_tokens is not None else mask.sum().clamp(min=1.0)
    loss = per_token.sum() / denom

    with torch.no_grad():
        n_in = loss_mask.to(logp.dtype).sum().clamp(min=1.0)
        n_kept = mask.sum().clamp(min=1.0)
        clipped = ((surr2 < surr1).to(mask.dtype) * mask).sum() / n_kept
        stats = {
            "clip_frac": float(clipped),
            "ratio_mean": float((ratio * mask).sum() / n_kept),
            "behav_w_mean": float((behav_w * mask).sum() / n_kept),
            "capped_frac": float(capped.sum() / n_in),
            "loss_tokens": float(mask.sum()),  # kept: in the loss mask and under the cap
            "in_tokens": float(loss_mask.sum()),
        }
    return loss, stats


def loglinear_prox_logp(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    behav_versions: torch.Tensor,
    current_version: int,
) -> torch.Tensor:
    """Approximate log pi_prox without an extra forward pass (docs/algorithm.md).

    logp_prox ~= logp_behav + alpha * (logp_theta - logp_behav) with
    alpha = (v_theta - 1 - v_behav) / (v_theta - v_behav): the proximal policy (version v_theta - 1)
    sits on the log-linear path between the behaviour policy and the current one. alpha is 0 when
    the token is one version old (then prox == behav, exactly). The result is detached.
    """
    gap = (current_version - behav_versions).to(logp.dtype)
    alpha = torch.where(gap > 0, (gap - 1.0) / gap.clamp(min=1.0), torch.zeros_like(gap))
    return (behav_logp + alpha * (logp - behav_logp)).detach()
