"""Emulated training: a PPO step takes the cost model's time for this rank's tokens; no weights, no gradients."""

from __future__ import annotations

import json
import shutil
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from areal_hpc.costmodel import RunSettings, emulated_cost, train_tokens
from areal_hpc.engines.base import TrainEngine
from areal_hpc.engines.emulated_gen import payload
from areal_hpc.rundir import EMULATED_STATE
from areal_hpc.store.columns import Batch, as_columns
from areal_hpc.utils import atomic_publish_dir, new_tmp_dir_beside


class EmulatedTrainEngine(TrainEngine):
    """Each data-parallel trainer takes `cost.train_s(its tokens)`. Rank 0 waits for every trainer's result
    before the version counts, so the largest share sets the step time, as the gradient all-reduce would.
    Its tokens are the positions a trainer computes: with `share_prefixes`, each group's common token prefix
    once per micro-batch part (costmodel.train_tokens, the simulator's arithmetic). A version's rate is the
    preset's under the run's objective: its extra or spared forwards (costmodel.RunSettings)."""

    def __init__(
        self,
        model_path: str,
        preset_name: str = "1.5B",
        cost_overrides: dict | None = None,
        time_scale: float = 1.0,
        payload_mb: float = 1.0,
        share_prefixes: bool = True,
        share_min_tokens: int = 32,
        max_tokens_per_mb: int = 4096,
        run: RunSettings | None = None,
    ):
        self.model_path = Path(model_path)
        self.cost = emulated_cost(preset_name, cost_overrides, run)  # run: the objective's extra forwards
        self.time_scale = time_scale
        self.version = 0
        self._weights = payload(payload_mb)
        self.share = (share_prefixes, share_min_tokens, max_tokens_per_mb)

    def positions(self, trajectories: Batch) -> tuple[int, int]:
        """(computed, unshared): the token positions of one pass over the trajectories, with and without
        each group's common prefix laid down once."""
        cols = as_columns(trajectories)
        groups: dict[int, list[np.ndarray]] = defaultdict(list)
        for gid, ids in zip(cols.seqs["group_id"].tolist(), cols.split("input_ids")):
            groups[gid].append(ids)
        computed = 0
        for seqs in groups.values():
            p = common_prefix(seqs)
            computed += train_tokens(p, [len(s) - p for s in seqs], *self.share)
        return computed, int(sum(len(s) for seqs in groups.values() for s in seqs))

    def _spend(self, seconds: float) -> None:
        time.sleep(seconds * self.time_scale)

    def compute_logprobs(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        self._spend(self.cost.prefill_s(sum(len(s) for s in sequences)))
        return [np.zeros(len(s), dtype=np.float32) for s in sequences]

    def ppo_update(
        self, trajectories: Batch, advantages: np.ndarray, minibatches: list[list[int]] | None = None
    ) -> dict[str, float]:
        computed, unshared = self.positions(trajectories)
        self._spend(self.cost.train_s(computed))
        self.version += 1
        self._weights["emulated.payload"][0] = float(self.version)  # the checksum changes as real weights would
        return {
            "loss": 0.0,
            "emulated_train_s": self.cost.train_s(computed),
            # one pass's positions (a real trainer counts every forward's): their ratio is the saving
            "train_tokens_computed": computed,
            "train_tokens_unshared": unshared,
        }

    def supervised_step(self, sequences: list[np.ndarray], loss_masks: list[np.ndarray], lr: float) -> float:
        self._spend(self.cost.train_s(sum(len(s) for s in sequences)))
        return 0.0

    def weights(self) -> dict[str, torch.Tensor]:
        return self._weights

    def export_hf(self, path: Path) -> Path:
        """The model folder it was started from (its tokenizer and config): emulation trains nothing."""
        tmp = new_tmp_dir_beside(Path(path))
        shutil.copytree(self.model_path, tmp, dirs_exist_ok=True)
        return atomic_publish_dir(tmp, Path(path))

    def save_checkpoint(self, path: Path) -> None:
        tmp = new_tmp_dir_beside(Path(path))
        (tmp / EMULATED_STATE).write_text(json.dumps({"version": self.version, "cost": self.cost.to_dict()}))
        atomic_publish_dir(tmp, Path(path))

    def load_checkpoint(self, path: Path) -> None:
        self.version = int(json.loads((Path(path) / EMULATED_STATE).read_text())["version"])
        self._weights["emulated.payload"][0] = float(self.version)


def common_prefix(seqs: list[np.ndarray]) -> int:
    """The number of leading tokens every sequence has in common."""
    n = min(len(s) for s in seqs)
    first = seqs[0][:n]
    same = np.logical_and.reduce([s[:n] == first for s in seqs[1:]]) if len(seqs) > 1 else np.ones(n, bool)
    return int(n if same.all() else np.argmin(same))
