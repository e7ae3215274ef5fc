"""What one simulated run measured, and the figures a sweep table shows of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SimResult:
    wall_s: float  # from the first weights published to the last version trained
    versions: int
    tokens_consumed: int
    gen_tokens: int  # sampled by training requests (consumed or not)
    staleness: dict[int, int]  # versions behind -> trajectories consumed
    gen_busy: float  # fraction of generator time spent stepping or loading weights
    train_busy: float
    dropped_stale: int
    rejected_uniform: int
    interrupted: int
    prefill_tokens: int  # prompts and partials processed again after recompute loads included
    version_wall_s: list[float] = field(default_factory=list)
    version_tokens: list[int] = field(default_factory=list)  # consumed by each version
    # token positions the trainers computed (each shared prefix once: trainer.share_prefixes) and the
    # positions of the tokens trained on, over every version
    train_tokens_computed: int = 0
    train_tokens_unshared: int = 0
    version_train_s: list[float] = field(default_factory=list)  # the trainers' time on each version
    gpus: int = 0  # generators x their devices + trainers (SimConfig.gpus)

    @property
    def train_s_per_version(self) -> float:
        return sum(self.version_train_s) / len(self.version_train_s) if self.version_train_s else math.nan

    @property
    def prefix_saving(self) -> float:
        """The share of the trained tokens' positions the trainers did not compute (0 without sharing)."""
        return 1 - self.train_tokens_computed / self.train_tokens_unshared if self.train_tokens_unshared else 0.0

    @property
    def steady_tokens_per_s(self) -> float:
        """Consumed tokens/s over the second half of the versions: without the pipeline's fill at the start
        (a long run's figure; the first batch waits for its longest answers whatever eta is)."""
        k = len(self.version_wall_s) // 2
        if k < 1 or len(self.version_wall_s) - k < 1:
            return self.consumed_tokens_per_s
        span = self.version_wall_s[-1] - self.version_wall_s[k - 1]
        return sum(self.version_tokens[k:]) / span if span > 0 else math.nan

    @property
    def consumed_tokens_per_s(self) -> float:
        return self.tokens_consumed / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def consumed_tokens_per_gpu_s(self) -> float:
        """Consumed tokens/s per GPU of the run: what a device more per generator has to earn back."""
        return self.consumed_tokens_per_s / self.gpus if self.gpus else math.nan

    @property
    def gen_tokens_per_s(self) -> float:
        return self.gen_tokens / self.wall_s if self.wall_s > 0 else math.nan

    def row(self) -> dict:
        """The figures a sweep table shows."""
        n = sum(self.staleness.values()) or 1
        return {
            "wall_s": self.wall_s,
            "consumed_tokens_per_s": self.consumed_tokens_per_s,
            "steady_tokens_per_s": self.steady_tokens_per_s,
            "gen_tokens_per_s": self.gen_tokens_per_s,
            "gpus": self.gpus,
            "consumed_tokens_per_gpu_s": self.consumed_tokens_per_gpu_s,
            "gen_busy": self.gen_busy,
            "train_busy": self.train_busy,
            "staleness_mean": sum(k * v for k, v in self.staleness.items()) / n,
            "staleness_max": max(self.staleness, default=0),
            "dropped_stale": self.dropped_stale,
            "rejected_uniform": self.rejected_uniform,
            "interrupted": self.interrupted,
            "prefill_tokens": self.prefill_tokens,
            "train_s_per_version": self.train_s_per_version,
            "train_tokens_computed": self.train_tokens_computed,
            "train_tokens_unshared": self.train_tokens_unshared,
        }
