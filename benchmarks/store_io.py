"""Shard store I/O benchmark: write and read back realistic rollout shards, report MB/s (--compression: per filter)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from areal_hpc.disk_estimate import TOKEN_BYTES, TRAJ_BYTES  # each trajectory its own episode here
from areal_hpc.store import list_shards, read_shard, read_shard_summary, write_shard
from areal_hpc.store.shard_schema import OFFSETS_DTYPE
from areal_hpc.store.shards import Compression
from areal_hpc.types import Trajectory

RESULTS = Path(__file__).resolve().parent / "results" / "store_io.json"
COMPARE_RESULTS = RESULTS.with_name("store_compression.json")
# what --compression compares: the gzip 1 and 4 and lzf, each with and without the byte shuffle
FILTERS = (
    Compression(),
    Compression("lzf", shuffle=False),
    Compression("lzf"),
    Compression("gzip", 1, shuffle=False),
    Compression("gzip", 1),
    Compression("gzip", 4, shuffle=False),
    Compression("gzip", 4),
)


VOCAB = 151_000


def token_ids(rng: np.random.Generator, n: int, dist: str) -> np.ndarray:
    """zipf: text's token frequencies fall off as 1/rank, and a BPE vocabulary numbers its tokens roughly by
    frequency (merges are learned most frequent first), so most ids are small; uniform: the incompressible
    worst case (the benchmark's ids before the compression comparison)."""
    if dist == "uniform":
        return rng.integers(0, VOCAB, n, dtype=np.int32)
    r = rng.zipf(1.1, n)
    return np.where(r > VOCAB, rng.integers(1, VOCAB, n), r).astype(np.int32) - 1


def make_shard(
    rng: np.random.Generator,
    n: int,
    group: int,
    version: int,
    gen_rank: int,
    max_gen: int,
    tokens: str = "uniform",
    gen_median: int = 350,
    first_group: int = 0,
):
    """n trajectories in groups of `group` samples: prompt ~100 tokens, long-tailed generation <= max_gen."""
    prompt = np.clip(rng.normal(100, 30, n // group + 1), 16, 400).astype(int).repeat(group)[:n]
    gen = np.clip(rng.lognormal(np.log(gen_median), 0.9, n), 1, max_gen).astype(int)
    out = []
    for i in range(n):
        p, g = int(prompt[i]), int(gen[i])
        L = p + g
        versions = np.full(L, -1, np.int32)
        # a few trajectories straddle a weight update
        versions[p:] = version - (np.arange(g) < rng.integers(0, g + 1)) * (rng.random() < 0.3)
        logp = np.zeros(L, np.float32)
        logp[p:] = -rng.exponential(0.7, g)
        mask = np.zeros(L, np.uint8)
        mask[p:] = 1
        out.append(
            Trajectory(
                prompt_id=first_group + i // group,
                group_id=first_group + i // group,
                sample_idx=i % group,
                input_ids=token_ids(rng, L, tokens),
                behav_logprobs=logp,
                versions=versions,
                loss_mask=mask,
                prompt_len=p,
                reward=float(rng.random() < 0.4),
                finish_reason="length" if g == max_gen else "stop",
                gen_rank=gen_rank,
                t_start=time.time(),
                t_end=time.time() + g * 0.02,
            )
        )
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shards", type=int, default=64, help="number of shards (default 64, ~120 MB)")
    ap.add_argument("--per-shard", type=int, default=256, help="trajectories per shard")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-gen", type=int, default=2000, help="longest generation in tokens")
    ap.add_argument("--read-passes", type=int, default=2, help="warm-cache read passes (mean reported)")
    ap.add_argument("--dir", default=None, help="directory to write into (default: a temporary dir)")
    ap.add_argument("--keep", action="store_true", help="keep the shards afterwards")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default=None, help=f"JSON result file (default {RESULTS}, --compression: {COMPARE_RESULTS})"
    )
    ap.add_argument("--compression", action="store_true", help="compare the HDF5 filters (FILTERS) on the same shards")
    ap.add_argument(
        "--tokens",
        default=None,
        help="token ids: zipf | uniform, comma-separated to compare (default: uniform; --compression: zipf,uniform)",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="--compression: interleaved passes over the filters (median)"
    )
    ap.add_argument("--trainer", action="store_true", help="the trainer's data time per version (trainer_data)")
    ap.add_argument("--versions", type=int, default=3, help="--trainer: versions timed (the first reads cold)")
    ap.add_argument("--batch", type=int, default=512, help="--trainer: groups per version")
    ap.add_argument("--gen-median", type=int, default=350, help="median generation length in tokens")
    ap.add_argument("--label", default="after", help="--trainer: the run's key in the result file (before, after)")
    args = ap.parse_args(argv)
    if args.compression:
        return compare(args)
    if args.trainer:
        from _trainer_data import trainer_data  # benchmarks/ is on the path when run as a script

        return trainer_data(args, _host())

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="store_io-"))
    rollout_dir = base / "rollouts"
    if rollout_dir.exists() and list_shards(rollout_dir):
        sys.exit(f"{rollout_dir} already holds shards; pick an empty --dir")
    rng = np.random.default_rng(args.seed)

    t0 = time.perf_counter()
    tokens = args.tokens or "uniform"
    shards = [
        make_shard(rng, args.per_shard, args.group, 1 + s // 4, s % 4, args.max_gen, tokens) for s in range(args.shards)
    ]
    gen_s = time.perf_counter() - t0
    n_traj = sum(len(s) for s in shards)
    n_tok = sum(len(t.input_ids) for s in shards for t in s)
    payload = n_tok * TOKEN_BYTES + n_traj * TRAJ_BYTES + args.shards * OFFSETS_DTYPE.itemsize
    mb = payload / 1e6

    try:
        t0 = time.perf_counter()
        for s, trajs in enumerate(shards):
            write_shard(rollout_dir, trajs, gen_rank=s % 4, seq=s // 4, run_id="bench")
        write_s = time.perf_counter() - t0
        del shards
        paths = list_shards(rollout_dir)
        file_bytes = sum(p.stat().st_size for p in paths)

        read_times = []
        for _ in range(max(1, args.read_passes)):
            t0 = time.perf_counter()
            got = sum(len(read_shard(p)) for p in paths)
            read_times.append(time.perf_counter() - t0)
            assert got == n_traj, (got, n_traj)
        read_s = float(np.mean(read_times))

        t0 = time.perf_counter()
        for p in paths:
            read_shard_summary(p)
        summary_s = time.perf_counter() - t0
    finally:
        if not args.keep:
            shutil.rmtree(base if not args.dir else rollout_dir, ignore_errors=True)

    res = {
        "benchmark": "store_io",
        **_host(),
        "dir": str(base),
        "shards": args.shards,
        "per_shard": args.per_shard,
        "tokens_dist": tokens,
        "trajectories": n_traj,
        "tokens": n_tok,
        "payload_bytes": payload,
        "file_bytes": file_bytes,
        "datagen_s": round(gen_s, 3),
        "write_s": round(write_s, 4),
        "write_MBps": round(mb / write_s, 1),
        "read_s_passes": [round(t, 4) for t in read_times],
        "read_MBps": round(mb / read_s, 1),
        "summary_s": round(summary_s, 4),
        "summary_shards_per_s": round(len(paths) / summary_s, 1),
    }
    out = Path(args.out or RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")

    print(
        f"payload: {mb:.1f} MB in {args.shards} shards, {n_traj} trajectories, {n_tok} tokens "
        f"({file_bytes / 1e6:.1f} MB on disk)"
    )
    print(f"write: {res['write_MBps']:.1f} MB/s ({write_s:.2f} s, tmp + fsync + os.replace per shard)")
    print(f"read: {res['read_MBps']:.1f} MB/s (read_shard, warm cache, mean of {len(read_times)} passes)")
    print(f"summary: {res['summary_shards_per_s']:.1f} shards/s (read_shard_summary)")
    print(f"result: {out}")
    return res


def _host() -> dict:
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
    }


def compare(args) -> dict:
    """Every filter in FILTERS on the same shards, the filters interleaved within each repeat (a shared
    host's speed drifts), per shard: bytes on disk, write (write_shard: pack, filter, checksum, fsync,
    rename) and read (read_shard, warm cache: decompress, verify the checksum, build the trajectories)."""
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="store_io-"))
    rows = []
    try:
        for dist in (args.tokens or "zipf,uniform").split(","):
            rng = np.random.default_rng(args.seed)
            shards = [
                make_shard(rng, args.per_shard, args.group, 1 + s // 4, s % 4, args.max_gen, dist)
                for s in range(args.shards)
            ]
            n_tok = sum(len(t.input_ids) for s in shards for t in s)
            got = {f.label: {"write": [], "read": [], "summary": [], "bytes": 0} for f in FILTERS}
            for rep in range(args.repeats):
                for comp in FILTERS:
                    d, g = base / f"{dist}-{comp.label}-{rep}", got[comp.label]
                    t0 = time.perf_counter()
                    for s, trajs in enumerate(shards):
                        write_shard(d, trajs, gen_rank=s % 4, seq=s // 4, run_id="bench", compression=comp)
                    g["write"].append(time.perf_counter() - t0)
                    paths = list_shards(d)
                    t0 = time.perf_counter()
                    assert sum(len(read_shard(p)) for p in paths) == sum(len(s) for s in shards)
                    g["read"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    for p in paths:
                        read_shard_summary(p)
                    g["summary"].append(time.perf_counter() - t0)
                    g["bytes"] = sum(p.stat().st_size for p in paths)
                    shutil.rmtree(d)
            ms = {
                k: {m: 1e3 * float(np.median(v[m])) / args.shards for m in ("write", "read", "summary")}
                for k, v in got.items()
            }
            none = ms["none"]["write"] + ms["none"]["read"]
            for comp in FILTERS:
                k = comp.label
                rows.append(
                    {
                        "tokens": dist,
                        "filter": k,
                        "shard_MB": round(got[k]["bytes"] / args.shards / 1e6, 3),
                        "ratio": round(got["none"]["bytes"] / got[k]["bytes"], 3),
                        "write_ms": round(ms[k]["write"], 2),
                        "read_ms": round(ms[k]["read"], 2),
                        "summary_ms": round(ms[k]["summary"], 3),
                        "added_write_read": round((ms[k]["write"] + ms[k]["read"]) / none - 1, 3),
                        "tokens_per_shard": n_tok // args.shards,
                    }
                )
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    res = {
        "benchmark": "store_compression",
        **_host(),
        "shards": args.shards,
        "per_shard": args.per_shard,
        "max_gen": args.max_gen,
        "repeats": args.repeats,
        "rows": rows,
    }
    out = Path(args.out or COMPARE_RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    head = f"{'tokens':8} {'filter':16} {'MB/shard':>9} {'ratio':>6} {'write ms':>9} {'read ms':>8}"
    head += f" {'summary ms':>10} {'w+r vs none':>11}"
    print(
        f"{args.shards} shards of {args.per_shard} trajectories, median of {args.repeats} interleaved passes, per shard"
    )
    print(head)
    for r in rows:
        print(
            f"{r['tokens']:8} {r['filter']:16} {r['shard_MB']:9.3f} {r['ratio']:6.2f} {r['write_ms']:9.2f} "
            f"{r['read_ms']:8.2f} {r['summary_ms']:10.3f} {100 * r['added_write_read']:+10.0f}%"
        )
    print(f"result: {out}")
    return res


if __name__ == "__main__":
    main()
