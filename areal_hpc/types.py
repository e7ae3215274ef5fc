"""Plain data records passed between engines, the store and the runtime (no torch, no I/O)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, make_dataclass

import numpy as np

from areal_hpc import count_schema

# finish_reason values a trajectory can carry (stored as fixed-width bytes in shards).
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Trajectory:
    """One sampled sequence: prompt + generated tokens, with per-token behaviour data.

    Per-token arrays cover the whole sequence (prompt included) so the trainer can use them
    directly; prompt positions have loss_mask 0, behav_logprobs 0 and versions -1.
    """

    prompt_id: int
    group_id: int
    sample_idx: int
    input_ids: np.ndarray  # int32 [L]
    behav_logprobs: np.ndarray  # float32 [L], log pi_behav(token) after temperature
    versions: np.ndarray  # int32 [L], policy version that produced each token (-1: prompt, or added by the workflow)
    loss_mask: np.ndarray  # uint8 [L], 1 on sampled tokens (0 on the prompt and on tokens the workflow added)
    prompt_len: int
    reward: float = 0.0
    finish_reason: str = "stop"
    gen_rank: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    # the dataset row it answers: its 0-based position in the data file (a jsonl line, a parquet row) or the
    # arithmetic task's problem index; -1 where unknown (shards of schema < 3)
    row_index: int = -1

    @property
    def gen_len(self) -> int:
        return int(len(self.input_ids) - self.prompt_len)

    @property
    def version_start(self) -> int:
        """The oldest version among sampled tokens (tokens a workflow added carry -1 and do not count)."""
        gen = self.versions[self.prompt_len :]
        gen = gen[gen >= 0]
        return int(gen.min()) if len(gen) else -1

    @property
    def version_end(self) -> int:
        gen = self.versions[self.prompt_len :]
        return int(gen.max()) if len(gen) else -1


# made from the schema (count_schema.COUNTS): a count added there is a field here
EpisodeCounts = make_dataclass(
    "EpisodeCounts",
    [("group_id", int), ("sample_idx", int), *count_schema.table_fields()],
    namespace={
        "__module__": __name__,
        "__doc__": """What one training episode did (areal_hpc.workflow), kept once per episode however many
    transcripts it left: a shard's episode table has a row of these per (group_id, sample_idx). Its counts are
    the schema's stored ones, in its order (engine requests, tool calls (that failed), tool seconds, reward calls
    past reward.timeout_s or raising, ...), each at its unset value by default.""",
    },
)


@dataclass(frozen=True, slots=True, order=True)
class SampleId:
    """A training episode: sample `sample` of group `group_id` ("group:sample" in log lines)."""

    group_id: int
    sample: int

    def __str__(self) -> str:
        return f"{self.group_id}:{self.sample}"


@dataclass(frozen=True, slots=True, order=True)
class EvalId:
    """A held-out evaluation episode: sample s of held-out problem i, k samples each, has index i * k + s
    ("eval:index" in log lines)."""

    index: int

    def __str__(self) -> str:
        return f"eval:{self.index}"


@dataclass(frozen=True, slots=True, order=True)
class RequestId:
    """One generate call: the `call`-th of an episode runner's life, made by the episode keyed `episode` (a SampleId
    or EvalId in the runtime; any hashable key in tests). Engines key requests by it as it is; one that needs a
    string makes its own at its edge (vLLM numbers its requests, the emulated engine hashes str(id))."""

    episode: Hashable
    call: int

    def __str__(self) -> str:
        return f"{self.episode}#{self.call}"


@dataclass
class GenRequest:
    """A request to the generation engine. A resumed request carries its earlier partial output.

    `max_new_tokens` counts the partial tokens too: a resumed request stops at the same length as one
    that was never interrupted. `greedy` requests (held-out evaluation) take the argmax and share the
    running batch with sampled ones.
    """

    request_id: Hashable  # a RequestId from the episode runner; engines only hash and compare it
    prompt_ids: list[int]
    max_new_tokens: int
    partial_ids: list[int] = field(default_factory=list)
    partial_logprobs: list[float] = field(default_factory=list)
    partial_versions: list[int] = field(default_factory=list)
    greedy: bool = False
    stop: list[str] = field(default_factory=list)  # strings that end the answer (kept in it), besides EOS

    def resumed(self, out: GenOutput) -> GenRequest:
        """This request again, continuing from an interrupted output (prompt + partial)."""
        return GenRequest(
            self.request_id,
            list(self.prompt_ids),
            self.max_new_tokens,
            list(out.output_ids),
            list(out.output_logprobs),
            list(out.output_versions),
            self.greedy,
            list(self.stop),
        )


@dataclass
class GenOutput:
    """What the generation engine returns for one request (partial output included on resume)."""

    request_id: Hashable  # the request's own id object
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str  # one of FINISH_REASONS
    request: GenRequest | None = None  # the request it answers (engines set it): an interrupted one resumes from it
