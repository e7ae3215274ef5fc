"""The trainer's data time per version (store_io.py --trainer): its shards read and what ppo_update consumes built."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from areal_hpc.config import Config
from areal_hpc.model import build_tiny_model
from areal_hpc.runtime.build import build_train_engine
from areal_hpc.store import write_shard

RESULTS = Path(__file__).resolve().parent / "results" / "trainer_data.json"


def write_versions(args, rollouts: Path) -> list[list]:
    """args.versions batches of args.batch groups, written in shards of args.per_shard trajectories that straddle
    versions as a generator's do; returns each version's share as rank 0 deals it (minibatches of (shard, indices))."""
    from store_io import make_shard

    rng = np.random.default_rng(args.seed)
    per_group, groups_per_shard = args.group, args.per_shard // args.group
    where = []  # group -> (shard name, first index)
    s = 0
    while len(where) < args.versions * args.batch:
        trajs = make_shard(
            rng, groups_per_shard * per_group, per_group, 1, s % 4, args.max_gen, "zipf", args.gen_median, len(where)
        )
        path = write_shard(rollouts, trajs, gen_rank=s % 4, seq=s // 4, run_id="bench")
        where += [(path.name, g * per_group) for g in range(groups_per_shard)]
        s += 1
    shares = []
    for v in range(args.versions):
        groups = where[v * args.batch : (v + 1) * args.batch]
        mbs = np.array_split(np.arange(len(groups)), 4)  # ppo.n_minibatches
        shares.append([[(groups[g][0], list(range(groups[g][1], groups[g][1] + per_group))) for g in mb] for mb in mbs])
    return shares


def no_forward(engine) -> None:
    """The engine's data path with the model calls taken out: logprobs are zeros, and a loss lays out its
    micro-batch's inputs (the ids tensors the forward would take) and returns zero."""
    engine.compute_logprobs = lambda seqs: [np.zeros(len(s), np.float32) for s in seqs]

    def loss(seqs, loss_fn, with_entropy=False, prepass=None, dense=None):
        mb = engine.batching.build(seqs)
        return torch.zeros(()), [], [torch.zeros(sum(mb.lengths))]

    engine._loss = loss
    engine._backward = lambda loss, last: None
    engine._optimizer_step = lambda: 0.0


def trainer_data(args, host: dict) -> dict:
    """One trainer takes each whole batch (the most a trainer's share can be): per version, reading its shards
    and building what ppo_update consumes (advantages, minibatches, micro-batch plans, each micro-batch's
    per-token inputs and ids tensors, the share's stats); the forwards and the optimizer are left out."""
    from areal_hpc.runtime.training import trainer

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="trainer_data-"))
    cfg = Config()
    cfg.rollout.max_new_tokens = args.max_gen
    cfg.trainer.max_tokens_per_mb = 32768  # jobs/math_1p5b_gpu.yaml
    cfg.ppo.drop_uniform_groups = True
    try:
        t0 = time.perf_counter()
        shares = write_versions(args, base / "rollouts")
        write_s = time.perf_counter() - t0
        engine = build_train_engine(cfg, build_tiny_model(base / "tiny", seed=0))
        no_forward(engine)
        cache = trainer.ShardCache(base / "rollouts") if hasattr(trainer, "ShardCache") else None
        times, tokens = [], []
        for v, share in enumerate(shares):
            t0 = time.perf_counter()
            stats = _version(trainer, cache, engine, cfg, share, v) if cache else _before(engine, cfg, base, share, v)
            times.append(time.perf_counter() - t0)
            tokens.append(stats["tokens"])
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    res = {
        "benchmark": "trainer_data",
        **host,
        "groups": args.batch,
        "answers": args.group,
        "max_gen": args.max_gen,
        "gen_median": args.gen_median,
        "per_shard": args.per_shard,
        "tokens_per_version": tokens,
        "write_s": round(write_s, 2),
        "version_s": [round(t, 3) for t in times],
        "mean_version_s": round(float(np.mean(times)), 3),
    }
    out = record(Path(args.out or RESULTS), args.label, res)
    print(f"trainer data time per version: {res['version_s']} s ({tokens[0]} tokens each), result: {out}")
    return res


def record(out: Path, label: str, res: dict) -> Path:
    """Keep the run under `label` in the result file beside the others (before / after a change)."""
    doc = json.loads(out.read_text()) if out.exists() else {}
    runs = doc.get("runs", {}) if doc.get("benchmark") == "trainer_data" else {}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "trainer_data", "runs": runs | {label: res}}, indent=2) + "\n")
    return out


def _version(trainer, cache, engine, cfg, share: list, version: int) -> dict:
    """The data path (runtime/training/trainer.py `_train`): the ledger's entries are the whole share here."""
    batch, mb_of = trainer.load_share(cache, share)
    stats = trainer.train_share(engine, cfg, batch, mb_of, len(share), version)
    cache.consumed((shard, i) for mb in share for shard, idx in mb for i in idx)
    return stats


def _before(engine, cfg, base: Path, share: list, version: int) -> dict:
    """The trainer's data path before the columnar store (training/trainer.py `_train`), to time the snapshot."""
    from areal_hpc.runtime.training.train_step import train_version
    from areal_hpc.runtime.training.trainer import share_stats
    from areal_hpc.store import read_shard

    trajs, mb_of, cache = [], [], {}
    for j, minibatch in enumerate(share):
        for shard, indices in minibatch:
            if shard not in cache:
                cache[shard] = read_shard(base / "rollouts" / shard)
            trajs += [cache[shard][i] for i in indices]
            mb_of += [j] * len(indices)
    stats, keep = train_version(engine, trajs, cfg, mb_of, len(share))
    gids = np.array([t.group_id for t in trajs], dtype=np.int64)
    stats.update(share_stats(trajs, version))
    stats["groups_kept"] = int(len(set(gids[keep].tolist()))) if trajs else 0
    stats["loss_tokens"] = int(sum(int(t.loss_mask.sum()) for t, k in zip(trajs, keep) if k))
    return stats
