"""A finished episode as the store's record: one Trajectory whose loss mask covers exactly the sampled tokens."""

from __future__ import annotations

import numpy as np

from areal_hpc.types import SampleId, Trajectory
from areal_hpc.workflow.runner import FinishedEpisode


def to_trajectory(ep: FinishedEpisode, sample: SampleId, prompt_id: int, gen_rank: int) -> Trajectory:
    """The transcript token for token: sampled segments carry their logprobs and versions and loss mask 1;
    the prompt and what the workflow added carry logprob 0, version -1 and loss mask 0."""
    ids, lps, vers, mask = [], [], [], []
    for seg in ep.segments:
        n = len(seg.ids)
        ids += seg.ids
        lps += seg.logprobs if seg.trained else [0.0] * n
        vers += seg.versions if seg.trained else [-1] * n
        mask += [int(seg.trained)] * n
    return Trajectory(
        prompt_id=prompt_id,
        group_id=sample.group_id,
        sample_idx=sample.sample,
        input_ids=np.asarray(ids, dtype=np.int32),
        behav_logprobs=np.asarray(lps, dtype=np.float32),
        versions=np.asarray(vers, dtype=np.int32),
        loss_mask=np.asarray(mask, dtype=np.uint8),
        prompt_len=len(ep.segments[0].ids),
        reward=float(ep.reward),
        finish_reason=ep.finish_reason,
        gen_rank=gen_rank,
        t_start=ep.t_start,
        t_end=ep.t_end,
        turns=ep.stats.turns,
        tool_calls=ep.stats.tool_calls,
        tool_errors=ep.stats.tool_errors,
        tool_s=ep.stats.tool_s,
        reward_timeouts=ep.stats.reward_timeouts,
        reward_errors=ep.stats.reward_errors,
    )
