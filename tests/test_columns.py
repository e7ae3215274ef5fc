"""The columnar path from shard to micro-batch: a trainer's shards read once, sliced, never made into records."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from areal_hpc.algo.advantages import longest_answer
from areal_hpc.config import Config
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.runtime.training.train_step import longest_answers, train_version
from areal_hpc.runtime.training.trainer import load_share, train_share
from areal_hpc.store import write_shard
from areal_hpc.store.cache import ShardCache
from areal_hpc.store.columns import TrajectoryColumns, as_columns, gather
from areal_hpc.store.shards import read_columns, read_shard
from areal_hpc.types import Trajectory


def test_a_share_gathered_from_columns_is_the_records_it_names(tmp_path, ppo_batch):
    trajs, _ = ppo_batch
    a = write_shard(tmp_path, trajs[:10], 0, 0)
    b = write_shard(tmp_path, trajs[10:], 1, 0)
    share = gather([(read_columns(b), [3, 0]), (read_columns(a), [9, 2, 5])])
    want = [read_shard(b)[3], read_shard(b)[0], read_shard(a)[9], read_shard(a)[2], read_shard(a)[5]]
    for got, w in zip(share.trajectories(), want, strict=True):
        for f in dataclasses.fields(Trajectory):
            np.testing.assert_array_equal(getattr(got, f.name), getattr(w, f.name), err_msg=f.name)
    assert share.seqs["version_start"].tolist() == [t.version_start for t in want]  # stored, not recomputed
    assert len(gather([])) == 0 and gather([]).seqs["reward"].dtype == np.float32  # an empty share


def test_longest_answers_over_columns_match_each_sequence():
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 9, 300)
    off = np.concatenate([[0], np.cumsum(lens)])
    mask = (rng.random(off[-1]) < 0.6).astype(np.uint8)
    cols = TrajectoryColumns(off, {"loss_mask": mask}, {})
    want = [longest_answer(mask[s:e]) for s, e in zip(off[:-1], off[1:])]
    assert longest_answers(cols).tolist() == want


def test_a_trainer_reads_each_shard_once_until_the_ledger_has_consumed_it(tmp_path, ppo_batch):
    trajs, _ = ppo_batch
    names = [write_shard(tmp_path, trajs[i : i + 8], 0, s).name for s, i in enumerate((0, 8))]
    cache = ShardCache(tmp_path)
    first = cache.get(names[0])
    assert cache.get(names[0]) is first and cache.reads == 1  # the next version's share: no second read
    cache.consumed([(names[0], i) for i in range(5)])
    assert cache.get(names[0]) is first and cache.reads == 1  # three of its trajectories are still to be dealt
    cache.consumed([(names[0], i) for i in range(5, 8)])
    assert names[0] not in cache.shards  # all consumed: no batch can deal it again
    small = ShardCache(tmp_path, max_bytes=1)  # room for the one just read
    small.get(names[0]), small.get(names[1])
    assert list(small.shards) == [names[1]]


def test_the_trainer_path_builds_no_records_and_trains_as_the_records_do(
    tmp_path, tiny_model_dir, ppo_batch, monkeypatch
):
    trajs = [dataclasses.replace(t, reward=float(t.sample_idx % 2)) for t in ppo_batch[0]]  # every group kept
    names = [write_shard(tmp_path, trajs[i : i + 8], 0, s).name for s, i in enumerate((0, 8))]
    share = [[(names[0], list(range(8)))], [(names[1], list(range(8)))]]
    cfg = Config()

    def engine():
        return TorchTrainEngine(str(tiny_model_dir), optimizer="sgd", lr=0.1, seed=0, max_tokens_per_mb=64)

    records = engine()
    want, _ = train_version(records, [t for n in names for t in read_shard(tmp_path / n)], cfg, [0] * 8 + [1] * 8, 2)

    def no_records(*a, **kw):
        raise AssertionError("a Trajectory was built on the trainer's path")

    monkeypatch.setattr(Trajectory, "__init__", no_records)
    cols = engine()
    batch, mb_of = load_share(ShardCache(tmp_path), share)
    got = train_share(cols, cfg, batch, mb_of, len(share), 0)
    assert got["samples"] == 16 and got["loss_tokens"] == int(as_columns(batch).tokens["loss_mask"].sum())
    for k in ("loss", "grad_norm", "clip_frac", "offpolicy_sums/n", "mismatch_sums/k3"):
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
