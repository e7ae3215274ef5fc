"""Helpers the tests share that the package itself never calls."""

from __future__ import annotations

import torch

from areal_hpc.algo.ppo import Objective, policy_loss


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
    """AReaL's decoupled PPO objective, token level, tokens over the cap dropped: `policy_loss` with its defaults.

    The summed loss is divided by `total_loss_tokens` (the loss-token count of the whole batch across all
    trainers) when given, else by the tokens this call keeps, so gradients add up across micro-batches and ranks.
    """
    obj = Objective(eps_clip=eps_clip, behav_cap=behav_imp_weight_cap)
    ones = torch.ones_like(logp)
    loss, stats = policy_loss(obj, logp, prox_logp, behav_logp, advantages, loss_mask, ones)
    denom = float(total_loss_tokens) if total_loss_tokens is not None else max(stats["loss_tokens"], 1.0)
    return loss / denom, stats
