"""A finished episode as the store's records: a Trajectory per transcript, loss mask on exactly the sampled tokens."""

from __future__ import annotations

import numpy as np

from areal_hpc.count_schema import STORED
from areal_hpc.types import EpisodeCounts, SampleId, Trajectory
from areal_hpc.workflow.records import FinishedEpisode, Segment


def to_trajectories(
    ep: FinishedEpisode, sample: SampleId, prompt_id: int, gen_rank: int, row_index: int = -1
) -> list[Trajectory]:
    """One Trajectory per transcript (more than one when the workflow rewrote its history with branch()), all
    with the episode's reward, sample index and dataset row, so they share its advantage. Its counts go in the
    shard's episode table once (episode_counts)."""
    out = [_one(t, ep, sample, prompt_id, gen_rank) for t in ep.transcripts]
    for t in out:
        t.row_index = row_index
    return out


def episode_counts(ep: FinishedEpisode, sample: SampleId) -> EpisodeCounts:
    """The episode's row of a shard's episode table: its stored counts (count_schema.STORED)."""
    return EpisodeCounts(sample.group_id, sample.sample, **{k: getattr(ep.stats, k) for k in STORED})


def _one(segments: list[Segment], ep: FinishedEpisode, sample: SampleId, prompt_id: int, gen_rank: int) -> Trajectory:
    """The transcript token for token: sampled segments carry their logprobs and versions (loss mask 1, or 0 when
    generated with train=False); the prompt (or a branch's context) and what the workflow added carry logprob 0,
    version -1, loss mask 0."""
    ids, mask = ids_and_mask(segments)
    lps = [x for s in segments for x in (s.logprobs if s.sampled else [0.0] * len(s.ids))]
    vers = [v for s in segments for v in (s.versions if s.sampled else [-1] * len(s.ids))]
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
    )


def ids_and_mask(segments: list[Segment]) -> tuple[list[int], list[int]]:
    """A transcript's token ids and loss mask (1 on trained segments): what trajectories and the warm start's
    supervised examples are built from."""
    ids = [i for s in segments for i in s.ids]
    return ids, [int(s.trained) for s in segments for _ in s.ids]
