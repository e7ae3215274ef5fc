"""Requests made outside an episode runner (tests, benchmarks): their ids, and each output as a one-turn trajectory."""

from __future__ import annotations

from areal_hpc.types import GenOutput, GenRequest, RequestId, SampleId, Trajectory
from areal_hpc.workflow.records import EpisodeStats, FinishedEpisode, Segment
from areal_hpc.workflow.samples import to_trajectories


def group_requests(prompt_ids: list[int], group_id: int, n_samples: int, max_new_tokens: int) -> list[GenRequest]:
    """n requests for one prompt, each the first call of sample s's episode (outputs regroup by their ids)."""
    return [GenRequest(sample_request(group_id, s), list(prompt_ids), max_new_tokens) for s in range(n_samples)]


def sample_request(group_id: int, sample: int) -> RequestId:
    """The id of the first (only) call of a training sample's episode."""
    return RequestId(SampleId(group_id, sample), 0)


def output_trajectory(out: GenOutput, prompt_id: int, reward: float, gen_rank: int = 0) -> Trajectory:
    """One engine output of a request made here (its id from sample_request) as the trajectory of a one-turn
    episode, built as the runner's are (workflow.samples): the prompt untrained, the answer trained."""
    sample = getattr(out.request_id, "episode", None)
    if not isinstance(sample, SampleId):
        raise ValueError(f"request {out.request_id} is not a training sample's: make its id with sample_request")
    answer = Segment(list(out.output_ids), True, list(out.output_logprobs), list(out.output_versions))
    segments = [Segment(list(out.prompt_ids), False), answer]
    ep = FinishedEpisode(out.request_id, reward, segments, EpisodeStats(), out.finish_reason, 0.0, 0.0)
    return to_trajectories(ep, sample, prompt_id, gen_rank)[0]
