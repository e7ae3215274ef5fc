"""A finished episode as the store's records: a Trajectory per transcript, loss mask on exactly the sampled tokens."""

from __future__ import annotations

import numpy as np

from areal_hpc.types import SampleId, Trajectory
from areal_hpc.workflow.records import FinishedEpisode, Segment


def to_trajectories(
    ep: FinishedEpisode, sample: SampleId, prompt_id: int, gen_rank: int, row_index: int = -1
) -> list[Trajectory]:
    """One Trajectory per transcript (more than one when the workflow rewrote its history with branch()), all
    with the episode's reward, sample index and dataset row, so they share its advantage. The episode's counts
    (turns, tools, reward failures) go on the first, so that sums over trajectories count each episode once."""
    out = [_one(t, ep, sample, prompt_id, gen_rank) for t in ep.transcripts]
    for t in out:
        t.row_index = row_index
    st = ep.stats
    first = out[0]
    first.turns, first.tool_calls, first.tool_errors, first.tool_s = st.turns, st.tool_calls, st.tool_errors, st.tool_s
    first.reward_timeouts, first.reward_errors = st.reward_timeouts, st.reward_errors
    return out


def _one(segments: list[Segment], ep: FinishedEpisode, sample: SampleId, prompt_id: int, gen_rank: int) -> Trajectory:
    """The transcript token for token: sampled segments carry their logprobs and versions (loss mask 1, or 0 when
    generated with train=False); the prompt (or a branch's context) and what the workflow added carry logprob 0,
    version -1, loss mask 0."""
    ids, lps, vers, mask = [], [], [], []
    for seg in segments:
        n = len(seg.ids)
        ids += seg.ids
        lps += seg.logprobs if seg.sampled else [0.0] * n
        vers += seg.versions if seg.sampled else [-1] * n
        mask += [int(seg.trained)] * n
    return Trajectory(
        prompt_id=prompt_id,
        group_id=sample.group_id,
        sample_idx=sample.sample,
        input_ids=np.asarray(ids, dtype=np.int32),
        behav_logprobs=np.asarray(lps, dtype=np.float32),
        versions=np.asarray(vers, dtype=np.int32),
        loss_mask=np.asarray(mask, dtype=np.uint8),
        prompt_len=len(segments[0].ids),
        reward=float(ep.reward),
        finish_reason=ep.finish_reason,
        gen_rank=gen_rank,
        t_start=ep.t_start,
        t_end=ep.t_end,
        turns=0,
        tool_calls=0,
    )
