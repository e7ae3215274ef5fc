"""The policy objective on flat per-token tensors: decoupled PPO and its menu of variants, pure (no I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class Objective:
    """Which objective: the knobs of docs/algorithm.md ("The objective menu"), each from its paper."""

    eps_clip: float = 0.2  # lower clip: the ratio may fall to 1 - eps_clip
    eps_clip_high: float | None = None  # upper clip (DAPO's clip-higher); None = eps_clip
    dual_clip: float = 0.0  # > 1: the loss of a negative-advantage token is at most -dual_clip * A (0 = off)
    behav_cap: float | None = None  # the behaviour weight's cap; None = no cap
    behav_weight: str = "drop"  # drop: a token over the cap leaves the loss | truncate: its weight is the cap (TIS)
    importance: str = "token"  # token | sequence: GSPO's length-normalised sequence ratio, clipped per sequence
    kl_coef: float = 0.0  # the KL penalty to the reference policy
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of KL(pi || ref))
    entropy_coef: float = 0.0  # the entropy bonus
    surrogate: str = "ppo"  # ppo: the clipped ratio | cispo: sg(clipped ratio) x log pi, a gradient on every token
    # sequence rejection: a sequence whose geometric-mean behaviour weight leaves [low, high] leaves the loss; 0 = off
    seq_reject_low: float = 0.0
    seq_reject_high: float = 0.0

    @property
    def rejects(self) -> bool:
        return bool(self.seq_reject_low or self.seq_reject_high)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled by pi: k1 = log(pi/ref), k2 = log(pi/ref)^2 / 2,
    k3 = ref/pi - 1 - log(ref/pi). The log-ratio is clamped to +-20 so k3's exp cannot overflow."""
    log_r = (ref_logp - logp).clamp(-20.0, 20.0)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"ppo.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")


def sequence_weights(loss_tokens: list[int], agg: str, total_tokens: float, total_seqs: float, norm_tokens: int):
    """Each sequence's per-token weight in the summed loss, so that the minibatch's loss is its aggregate.

    token_mean: 1 / (loss tokens of the minibatch); seq_mean_token_mean: 1 / (sequences x this sequence's loss
    tokens); seq_mean_token_sum_norm (Dr.GRPO): 1 / (sequences x norm_tokens), a constant. The totals are those
    of the whole minibatch on every trainer, so micro-batches and ranks sum to the same loss.
    """
    if agg == "token_mean":
        return [1.0 / max(total_tokens, 1.0)] * len(loss_tokens)
    if agg == "seq_mean_token_mean":
        return [1.0 / (max(total_seqs, 1.0) * max(n, 1)) for n in loss_tokens]
    if agg == "seq_mean_token_sum_norm":
        return [1.0 / (max(total_seqs, 1.0) * norm_tokens)] * len(loss_tokens)
    raise ValueError(f"ppo.loss_agg must be one of {', '.join(LOSS_AGGS)}; got {agg!r}")


def segment_mean(values: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """Per token, the mean of `values` over the masked tokens of its sequence (`seq`: each token's sequence)."""
    m = mask.to(values.dtype)
    sums = torch.zeros(n_seqs, dtype=values.dtype, device=values.device).index_add_(0, seq, values * m)
    counts = torch.zeros(n_seqs, dtype=values.dtype, device=values.device).index_add_(0, seq, m)
    return (sums / counts.clamp(min=1.0))[seq]


def rejected_sequences(obj: Objective, seq_log_behav_w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 on the loss tokens of sequences whose exp(mean log(pi_prox / pi_behav)) is outside [low, high], else 0.
    Compared in log space: a far-off sequence's weight may overflow."""
    lw = torch.where(mask > 0, seq_log_behav_w.detach(), torch.zeros_like(seq_log_behav_w))
    out = torch.zeros_like(mask, dtype=torch.bool)
    if obj.seq_reject_low > 0:
        out |= lw < math.log(obj.seq_reject_low)
    if obj.seq_reject_high > 0:
        out |= lw > math.log(obj.seq_reject_high)
    return out.to(mask.dtype) * mask


def policy_loss(
    obj: Objective,
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    weight: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    seq_log_ratio: torch.Tensor | None = None,
    seq_log_behav_w: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over tokens of weight * (policy loss - entropy_coef * entropy + kl_coef * KL), and its stats.

    Per token, u = pi / pi_prox is clipped to [1 - eps_clip, 1 + eps_clip_high] (PPO, DAPO) and the result is
    bounded by dual_clip for A < 0; with surrogate=cispo the loss is -sg(clip(u)) * A * log pi instead (CISPO).
    w = pi_prox / pi_behav corrects for the policy that sampled it, carries no gradient, and over `behav_cap`
    either drops the token or is truncated to the cap (TIS). With seq_reject_low/high, every token of a
    sequence whose exp(`seq_log_behav_w`) leaves that band leaves the loss (sequence rejection). With
    importance=sequence, `seq_log_ratio` and `seq_log_behav_w` hold each token's sequence mean of
    log(pi / pi_prox) and log(pi_prox / pi_behav) (detached): u = s * pi / sg(pi) has the value of the sequence
    ratio s and its gradient (GSPO), and w is the sequence's length-normalised weight. `weight` is each token's
    aggregation weight (sequence_weights); the KL (to `ref_logp`) and the entropy bonus (`entropy`, with grad if
    it is to be trained) apply to every token of the loss mask.
    """
    mask = loss_mask.to(logp.dtype)
    prox_logp, behav_logp = prox_logp.detach(), behav_logp.detach()
    advantages = advantages.detach().to(logp.dtype)
    weight = weight.detach().to(logp.dtype)
    sequence = obj.importance == "sequence"
    if (sequence or obj.rejects) and seq_log_behav_w is None:
        raise ValueError("importance=sequence and sequence rejection need seq_log_behav_w (PolicyStep's prepass)")

    log_w = seq_log_behav_w.detach() if sequence else prox_logp - behav_logp
    behav_w = torch.exp(torch.where(mask > 0, log_w, torch.zeros_like(log_w)))
    over = (behav_w > obj.behav_cap).to(mask.dtype) * mask if obj.behav_cap is not None else torch.zeros_like(mask)
    kept = mask * (1 - over) if obj.behav_weight == "drop" else mask
    rejected = rejected_sequences(obj, seq_log_behav_w, mask) if obj.rejects else torch.zeros_like(mask)
    kept = kept * (1 - rejected)
    if obj.behav_weight == "truncate" and obj.behav_cap is not None:
        behav_w = behav_w.clamp(max=obj.behav_cap)
    # Masked and dropped tokens are zeroed *before* anything multiplies: a where() around the product alone
    # keeps the forward finite, but its backward still meets 0 * inf (an overflowing ratio or weight) = NaN,
    # and one NaN gradient spoils every weight that is then published.
    keep = kept > 0
    zero = torch.zeros_like(logp)
    behav_w = torch.where(keep, behav_w, zero)
    if sequence:
        s = torch.exp(torch.where(keep, seq_log_ratio.detach(), zero))
        ratio = s * torch.exp(torch.where(keep, logp - logp.detach(), zero))
    else:
        ratio = torch.exp(torch.where(keep, logp - prox_logp, zero))
    high = obj.eps_clip if obj.eps_clip_high is None else obj.eps_clip_high
    clipped = torch.clamp(ratio, 1.0 - obj.eps_clip, 1.0 + high)
    surr1, surr2 = ratio * advantages, clipped * advantages
    if obj.surrogate == "cispo":  # the clipped ratio only weighs the token: every token keeps log pi's gradient
        pg = -clipped.detach() * advantages * torch.where(keep, logp, zero)
        clip_hit = (clipped != ratio).to(mask.dtype)
    else:
        pg = -torch.minimum(surr1, surr2)
        clip_hit = (surr2 < surr1).to(mask.dtype)
    if obj.dual_clip > 0 and obj.surrogate == "ppo":
        bound = -obj.dual_clip * advantages
        pg = torch.where(advantages < 0, torch.minimum(pg, bound), pg)
    per_token = behav_w * pg * weight * kept

    stats_in: dict[str, torch.Tensor] = {}
    if obj.kl_coef and ref_logp is not None:
        kl = torch.where(mask > 0, kl_estimate(logp, ref_logp.detach(), obj.kl_estimator), zero)
        per_token = per_token + obj.kl_coef * kl * weight * mask
        stats_in["kl"] = kl
    if entropy is not None:  # given (with its gradient) only when there is an entropy bonus
        per_token = per_token - obj.entropy_coef * entropy * weight * mask
        stats_in["entropy_bonus"] = obj.entropy_coef * entropy
    loss = per_token.sum()

    with torch.no_grad():
        n_in = mask.sum().clamp(min=1.0)
        n_kept = kept.sum().clamp(min=1.0)
        stats = {
            "clip_frac": float((clip_hit * kept).sum() / n_kept),
            "ratio_mean": float((ratio * kept).sum() / n_kept),
            "behav_w_mean": float((behav_w * kept).sum() / n_kept),
            "capped_frac": float(over.sum() / n_in) if obj.behav_weight == "drop" else 0.0,
            "loss_tokens": float(kept.sum()),  # kept: in the loss mask and not dropped at the cap
            "in_tokens": float(mask.sum()),
        }
        if obj.behav_weight == "truncate":
            stats["truncated_frac"] = float(over.sum() / n_in)
        if obj.rejects:
            stats["seq_rejected_frac"] = float(rejected.sum() / n_in)  # a share of loss tokens, before the cap
        if sequence:
            stats["seq_ratio_mean"] = float((ratio * kept).sum() / n_kept)
        for k, v in stats_in.items():
            stats[k] = float((v.detach() * mask).sum() / n_in)
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
