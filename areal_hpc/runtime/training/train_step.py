"""One policy version on a trainer's share of a batch: reward shaping, advantages, the learning rate, the update.

Both training loops (the synchronous one and a trainer rank) take this step, so the objective's settings
mean the same thing in both.
"""

from __future__ import annotations

import numpy as np

from areal_hpc.algo.advantages import batch_advantages, overlong_penalty
from areal_hpc.algo.schedule import lr_at
from areal_hpc.config import Config
from areal_hpc.engines import TrainEngine
from areal_hpc.store.columns import Batch, TrajectoryColumns, as_columns


def train_version(
    engine: TrainEngine,
    trajs: Batch,
    cfg: Config,
    minibatch_of: list[int] | None = None,
    n_minibatches: int = 0,
) -> tuple[dict, np.ndarray]:
    """Train `trajs` (this trainer's share: columns, or Trajectory records) into the next version; returns its
    stats and which sequences were kept.

    `minibatch_of[i]` is the minibatch trajectory i was dealt to (rank 0's split, the same count on every
    trainer); None: the engine splits the share itself. The stored rewards are not changed: the overlong
    penalty enters the advantage only, so accuracy metrics stay those of the answers.
    """
    pc, rc, tc = cfg.ppo, cfg.rollout, cfg.trainer
    batch = as_columns(trajs)
    r = batch.seqs["reward"].astype(np.float64)
    penalty = overlong_penalty(
        longest_answers(batch),
        rc.max_new_tokens,
        cfg.reward.overlong_buffer,
        cfg.reward.overlong_penalty,
    )
    gids = batch.seqs["group_id"].astype(np.int64)
    sids = batch.seqs["sample_idx"].astype(np.int64)  # an episode's branches share its advantage
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
    stats = engine.ppo_update(batch if len(kept) == len(batch) else batch.take(kept), adv[kept], minibatches)
    stats["lr"] = lr
    if cfg.reward.overlong_buffer:
        stats["overlong_penalty"] = float(penalty.mean()) if len(penalty) else 0.0
    return stats, keep


def longest_answers(batch: TrajectoryColumns) -> np.ndarray:
    """Each sequence's longest run of trained tokens (algo.advantages.longest_answer), over the columns at once: a
    run starts where the mask turns on or a sequence begins on it, ends where it turns off or the sequence ends."""
    m, off = batch.tokens["loss_mask"] > 0, batch.offsets
    starts_seq, ends_seq = np.zeros(len(m) + 1, bool), np.zeros(len(m) + 1, bool)
    starts_seq[off[:-1]], ends_seq[off[1:]] = True, True
    on = np.concatenate([[False], m, [False]])
    starts = np.flatnonzero(on[1:] & (~on[:-1] | starts_seq))
    ends = np.flatnonzero(on[:-1] & (~on[1:] | ends_seq))  # one past each run's last token
    out = np.zeros(len(batch), np.int64)
    np.maximum.at(out, np.searchsorted(off, starts, side="right") - 1, ends - starts)
    return out
