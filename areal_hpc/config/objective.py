"""The objective menu's combination checks on a loaded config (docs/algorithm.md), and its one-line warnings."""

from __future__ import annotations

import logging
import os
from typing import Any

from areal_hpc.config.errors import ConfigError

log = logging.getLogger("areal_hpc.config")
_warned: set[str] = set()  # each warning once per process
# every rank loads the config: the launcher (no rank) and rank 0 say it, so a run's log has it once
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
DISTILL_ESTIMATORS = ("sample", "full")  # distill.estimator: the sampled gap as an advantage | the exact KL in the loss


def check_objective(cfg: Any) -> None:
    """Refuse combinations that make no sense, in one line; log the doubtful ones (objective_warnings)."""
    ppo_cfg = cfg.ppo
    # CISPO's paper bounds only the upper side (a large eps_clip): its upper clip may be the smaller one
    if (
        ppo_cfg.eps_clip_high is not None
        and not ppo_cfg.eps_clip_high >= ppo_cfg.eps_clip
        and ppo_cfg.objective == "ppo"
    ):
        raise ConfigError(
            f"config ppo.eps_clip_high={ppo_cfg.eps_clip_high!r} is below ppo.eps_clip={ppo_cfg.eps_clip!r}; "
            "clip-higher "
            "raises the upper clip (e.g. 0.28 with 0.2), or leave it null for eps_clip"
        )
    if 0 < ppo_cfg.dual_clip <= 1:
        raise ConfigError(f"config ppo.dual_clip={ppo_cfg.dual_clip!r} must be 0 (off) or above 1 (e.g. 3)")
    _check_corrections(ppo_cfg)
    trainer_cfg = cfg.trainer
    _check_distill_estimator(cfg.distill, trainer_cfg)
    if (
        ppo_cfg.kl_coef
        and trainer_cfg.engine == "deepspeed"
        and trainer_cfg.zero_stage == 3
        and not trainer_cfg.lora_rank
    ):
        # the reference would be a full, unsharded copy on every trainer: what ZeRO-3 is chosen to avoid
        # (with LoRA the reference is the base with the adapter off: no copy)
        raise ConfigError(
            "config ppo.kl_coef needs trainer.zero_stage 1 or 2 under DeepSpeed (ZeRO-3 shards no reference), "
            "or LoRA (trainer.lora_rank)"
        )
    if cfg.reward.overlong_buffer >= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"config reward.overlong_buffer={cfg.reward.overlong_buffer} must be below "
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} (the penalty starts that many tokens before it)"
        )
    if cfg.trainer.warmup_versions >= cfg.trainer.versions and cfg.trainer.warmup_versions:
        raise ConfigError(
            f"config trainer.warmup_versions={cfg.trainer.warmup_versions} must be below "
            f"trainer.versions={cfg.trainer.versions}"
        )
    if any(os.environ.get(v, "0") != "0" for v in _RANK_VARS):
        return
    for line in objective_warnings(cfg):
        if line not in _warned:
            _warned.add(line)
            log.warning("%s", line)


def _check_corrections(pc: Any) -> None:
    """CISPO and sequence rejection: what each combines with."""
    if pc.objective == "cispo" and pc.importance == "sequence":
        raise ConfigError(
            "config ppo.objective=cispo weighs each token by its own clipped ratio; it needs ppo.importance=token "
            "(GSPO's sequence ratio is ppo.objective=ppo)"
        )
    if pc.objective == "cispo" and pc.dual_clip:
        raise ConfigError(
            f"config ppo.dual_clip={pc.dual_clip!r} does nothing with ppo.objective=cispo (its clipped weight is "
            "bounded already); set ppo.dual_clip=0"
        )
    if not 0 <= pc.seq_reject_low < 1:
        raise ConfigError(f"config ppo.seq_reject_low={pc.seq_reject_low!r} must be 0 (off) or in (0, 1), e.g. 0.5")
    if pc.seq_reject_high and not pc.seq_reject_high > 1:
        raise ConfigError(f"config ppo.seq_reject_high={pc.seq_reject_high!r} must be 0 (off) or above 1, e.g. 2")
    if (pc.seq_reject_low or pc.seq_reject_high) and not pc.decoupled:
        raise ConfigError(
            "config ppo.seq_reject_low/high need ppo.decoupled=true: they bound pi_prox / pi_behav, and plain PPO "
            "has no proximal policy"
        )


def _check_distill_estimator(dc: Any, tc: Any) -> None:
    """distill.estimator: a known one; full computes its KL in the fused head, which ZeRO-3 (without LoRA) has not."""
    if dc.estimator not in DISTILL_ESTIMATORS:
        raise ConfigError(
            f"config distill.estimator={dc.estimator!r} is not allowed; choose one of {', '.join(DISTILL_ESTIMATORS)}"
        )
    if dc.estimator == "full" and dc.teacher and tc.engine == "deepspeed" and tc.zero_stage == 3 and not tc.lora_rank:
        raise ConfigError(
            "config distill.estimator=full needs trainer.zero_stage 1 or 2 under DeepSpeed (ZeRO-3's head runs in "
            "checkpointed calls, without the fused loss the exact KL lives in), or LoRA (trainer.lora_rank)"
        )


def objective_warnings(cfg: Any) -> list[str]:
    """One line per setting that runs but is probably not what was meant."""
    pc, out = cfg.ppo, []
    if pc.importance == "sequence" and pc.loss_agg == "token_mean":
        out.append(
            "config ppo.importance=sequence with ppo.loss_agg=token_mean weighs each sequence by its length; "
            "GSPO averages per sequence: ppo.loss_agg=seq_mean_token_mean"
        )
    if pc.prox == "loglinear" and (pc.seq_reject_low or pc.seq_reject_high):
        # a token one version old has prox == behav exactly on the log-linear path: its weight is 1 whatever the
        # engines' numeric gap, so the band never sees the training-inference mismatch of fresh data
        out.append(
            "config ppo.seq_reject_low/high with ppo.prox=loglinear: fresh tokens' weights are exactly 1 there, so "
            "the band cannot see a training-inference mismatch; use ppo.prox=recompute"
        )
    if cfg.distill.teacher and cfg.distill.task_reward and pc.drop_uniform_groups:
        # a group whose answers all scored alike has no task advantage, but the teacher still scores every token
        # (without the task reward this is refused: config/checks.py)
        out.append(
            "config distill.teacher with ppo.drop_uniform_groups=true drops groups whose answers all scored alike, "
            "though the teacher's term still teaches on them; ppo.drop_uniform_groups=false keeps them"
        )
    task_trains = cfg.distill.task_reward or not cfg.distill.teacher
    if task_trains and cfg.rollout.n_samples == 1 and pc.adv_scope == "group" and pc.adv_norm != "none":
        # a one-answer group's advantage is its reward minus itself: the task reward trains nothing, unsaid
        out.append(
            "config rollout.n_samples=1 with ppo.adv_scope=group: a one-answer group has no task advantage, so the "
            "task reward does not train; rollout.n_samples >= 2, ppo.adv_scope=batch, or (distilling alone) "
            "distill.task_reward=false"
        )
    return out
