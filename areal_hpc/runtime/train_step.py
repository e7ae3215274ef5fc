"""One policy version on a trainer's share of a batch: reward shaping, advantages, the learning rate, the update.

Both training loops (the synchronous one and a trainer rank) take this step, so the objective's settings
mean the same thing in both.
"""

from __future__ import annotations

import numpy as np

from areal_hpc.algo.advantages import batch_advantages, longest_answer, overlong_penalty
from areal_hpc.algo.schedule import lr_at
from areal_hpc.config import Config
from areal_hpc.engines import TrainEngine
from areal_hpc.types import Trajectory


def train_version(
    engine: TrainEngine,
    trajs: list[Trajectory],
    cfg: Config,
    minibatch_of: list[int] | None = None,
    n_minibatches: int = 0,
) -> tuple[dict, np.ndarray]:
    """Train `trajs` (this trainer's share) into the next version; returns its stats and which sequences were kept.

    `minibatch_of[i]` is the minibatch trajectory i was dealt to (rank 0's split, the same count on every
    trainer); None: the engine splits the share itself. The stored rewards are not changed: the overlong
    penalty enters the advantage only, so accuracy metrics stay those of the answers.
    """
    pc, rc, tc = cfg.ppo, cfg.rollout, cfg.trainer
    r = np.array([t.reward for t in trajs], dtype=np.float64)
    penalty = overlong_penalty(
        np.array([longest_answer(t.loss_mask) for t in trajs]),
        rc.max_new_tokens,
        cfg.reward.overlong_buffer,
        cfg.reward.overlong_penalty,
    )
    gids = np.array([t.group_id for t in trajs], dtype=np.int64)
    sids = np.array([t.sample_idx for t in trajs], dtype=np.int64)  # an episode's branches share its advantage
    adv, keep = batch_advantages(
        r + penalty,
        gids,
        pc.adv_norm,
        pc.drop_uniform_groups,
        sids,
        pc.adv_scope,
        engine.sum_across_trainers,
        pc.adv_std,
    )
    if cfg.distill.teacher and not cfg.distill.task_reward:  # distillation alone: the teacher's term is the advantage
        adv = np.zeros_like(adv)
    kept = np.flatnonzero(keep)
    minibatches = None
    if minibatch_of is not None:
        minibatches = [[k for k, i in enumerate(kept) if minibatch_of[i] == j] for j in range(n_minibatches)]
    lr = lr_at(engine.version, tc.lr, tc.lr_schedule, tc.warmup_versions, tc.versions)
    engine.set_lr(lr)
    stats = engine.ppo_update([trajs[i] for i in kept], adv[kept], minibatches)
    stats["lr"] = lr
    if cfg.reward.overlong_buffer:
        stats["overlong_penalty"] = float(penalty.mean()) if len(penalty) else 0.0
    return stats, keep
