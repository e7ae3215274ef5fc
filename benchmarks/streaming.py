"""Streaming generation on the real asynchronous runtime, for the torch and the vLLM engine: consumed
tokens/s, how busy each role is, how full the engine stays, and the generator's tokens/s against its
engine's own offline throughput on the same requests.

Workload: long-tailed lengths as in reasoning. An untrained tiny model samples up to --max-new tokens
(EOS is one token in 18, so lengths are roughly geometric with a long tail); 1 generator + 1 trainer,
every group trained on (no dynamic sampling). Variants: eta=0 (the synchronous baseline, same code),
and eta=4 under each rollout.weight_update (keep_kv, recompute, drain). The engine gets --slots running
sequences (4): generation is then the scarce resource, as memory-bound decode is on GPUs. With many
slots this tiny model generates several times faster than one trainer trains, the trainer is the
bottleneck, and the generator waits at the staleness gate by design (`--slots 16` shows that regime).

Cores: the run has `cluster.pin_roles=true`, so the generator has one core to itself and the scheduler,
the trainer and the reward workers share the other, as a generator has its own GPUs on a cluster.

The ceiling: after each run, the same engine (same slots, same thread count, on the generator's core)
generates the run's own stored requests (each prompt with exactly its stored answer length, EOS
ignored), all added at once and stepped to completion with no runtime around it; twice, and the mean is
the ceiling. This shared machine's speed drifts: one engine's offline figure moved by up to 40% between
measurements minutes apart (2026-12-02), so the two measurements' spread is printed beside each ratio to
it. Two shares measured inside the run are free of that drift and isolate the loop's own cost: the
generating time spent inside engine steps (the rest is the loop between steps), and the share of a
core the steps got (the rest went to other processes on the generator's core).

The streaming generator's tokens/s counts every token its engine sampled (one per running sequence per
step) over its generating time: also the held-out evaluation's greedy answers, which run in the same
stream (8% of the tokens at 12 versions) and are not stored. `stream_over_offline` counts the stored
answers only, so it understates the generator by that share.

    .venv/bin/python benchmarks/streaming.py                    # both engines, about 30 minutes on 2 cores
    .venv/bin/python benchmarks/streaming.py --engines torch --versions 15
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from _runs import (  # benchmarks/ is on the path when a benchmark runs as a script
    BASE_WORKLOAD,
    VARIANTS,
    launch_run,
    overlap,
)
from _runs import figures as run_figures

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from areal_hpc.rundir import RunDir  # noqa: E402 (after the path: runs from a checkout)
from areal_hpc.runtime.cores import CoreSplit  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

# generation on its own core, the rest on the other, as generation has its own GPUs on a cluster
WORKLOAD = [*BASE_WORKLOAD, "logging.eval_prompts=4", "cluster.pin_roles=true"]
SPLIT = CoreSplit.of(os.sched_getaffinity(0))  # the split the run's ranks make (areal_hpc.runtime.cores)


def figures(run_dir: Path, summary: dict) -> dict:
    """The shared figures (benchmarks/_runs.py), plus the generator's tokens per busy second."""
    import pandas as pd

    from areal_hpc.runtime.comm.timeline import load_timeline
    from areal_hpc.store import load_trajectories

    out = run_figures(run_dir, summary)
    tl = load_timeline(run_dir)
    gen_spans = tl[(tl.role == "generator") & (tl.event == "generate")]
    gen = out["generating_s"]
    train_spans = tl[(tl.role == "trainer") & (tl.event == "train")]
    ts, te = train_spans.t_start.to_numpy(), train_spans.t_end.to_numpy()
    # the share of generating time the trainer was training beside it (on its own core, sharing caches and memory)
    out["train_during_generate"] = (
        sum(overlap(ts, te, a, b) for a, b in zip(gen_spans.t_start, gen_spans.t_end, strict=True)) / gen
    )
    trajs: pd.DataFrame = load_trajectories(run_dir)
    out["generated_tokens"] = int(trajs["gen_len"].sum())
    out["stream_gen_tokens_per_busy_s"] = out["generated_tokens"] / gen
    out["stream_gen_tokens_per_rl_s"] = out["generated_tokens"] / summary["rl_wall_s"]
    # every token the engine sampled (one per running sequence per step): also the held-out evaluations
    # that share the stream and the partial answers dropped at the stop, which the stored count leaves out
    out["stream_sampled_tokens_per_busy_s"] = out["sampled_tokens"] / gen
    return out


def offline_ceiling(engine: str, run_dir: Path, model: Path, cfg) -> float:
    """The engine's own tokens/s on the run's stored requests, on the generator's cores: all added at once,
    stepped to completion."""
    import torch

    from areal_hpc.engines import make_generation_engine
    from areal_hpc.engines.base import generate
    from areal_hpc.store import list_shards, read_shard
    from areal_hpc.types import GenRequest

    torch.set_num_threads(cfg.cluster.threads_per_rank)  # as the generator rank runs, on its cores
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, SPLIT.generation)  # the engine's threads start here and inherit it
    rc = cfg.rollout
    kw = {"kv_cache_gib": rc.kv_cache_gib} if engine == "vllm" else {}
    eng = make_generation_engine(
        engine, model_path=str(model), temperature=rc.temperature, seed=0, max_num_seqs=rc.max_num_seqs, **kw
    )
    eng.ignore_eos = True  # every request produces exactly its stored length
    reqs = []
    for shard in list_shards(RunDir(run_dir).rollouts):
        for t in read_shard(shard):
            reqs.append(GenRequest(f"{len(reqs)}", t.input_ids[: t.prompt_len].tolist(), t.gen_len))
    try:
        generate(eng, reqs[:8])  # warm-up
        t = time.perf_counter()
        outs = generate(eng, reqs)
        secs = time.perf_counter() - t
    finally:
        eng.close()
        os.sched_setaffinity(0, allowed)
    return sum(len(o.output_ids) for o in outs) / secs


def run_variant(engine: str, name: str, args, out_root: Path) -> dict:
    run_dir = out_root / f"{engine}-{name}"
    overrides = [
        *WORKLOAD,
        *VARIANTS[name],
        f"rollout.engine={engine}",
        f"rollout.max_new_tokens={args.max_new}",
        f"rollout.max_num_seqs={args.slots}",
        f"rollout.max_concurrent_groups={args.groups}",
        f"trainer.versions={args.versions}",
    ]
    cfg, s = launch_run(run_dir, overrides, out_root / "model")
    r = {
        **{
            k: s[k]
            for k in ("consumed_tokens_per_s", "rl_wall_s", "dropped_stale", "rejected_uniform", "aborted_requests")
        },
        **figures(run_dir, s),
    }
    # twice, minutes apart: how far the host's own speed moved is the error bar of every ratio to it
    first, second = (offline_ceiling(engine, run_dir, out_root / "model", cfg) for _ in range(2))
    r["offline_gen_tokens_per_s"] = (first + second) / 2
    r["offline_spread"] = abs(first - second) / r["offline_gen_tokens_per_s"]
    r["stream_over_offline"] = r["stream_gen_tokens_per_busy_s"] / r["offline_gen_tokens_per_s"]
    r["sampled_over_offline"] = r["stream_sampled_tokens_per_busy_s"] / r["offline_gen_tokens_per_s"]
    r["bottleneck"] = "generator" if r["generator_busy"] >= r["trainer_busy"] else "trainer"
    r["bottleneck_busy"] = max(r["generator_busy"], r["trainer_busy"])
    return r


def write_json(path: Path, result: dict) -> None:
    from areal_hpc.utils import atomic_write_text

    atomic_write_text(path, json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="torch,vllm")
    ap.add_argument("--versions", type=int, default=25, help="policy versions per variant")
    ap.add_argument("--max-new", type=int, default=256)
    # 4 slots make generation the scarce resource, as decode is on GPUs: the regime streaming is for. With
    # more slots the tiny model generates faster than one trainer trains, and the generator waits at the gate
    ap.add_argument("--slots", type=int, default=4, help="rollout.max_num_seqs: the engine's running-batch size")
    ap.add_argument(
        "--groups", type=int, default=0, help="rollout.max_concurrent_groups (0: the default, max_num_seqs)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "streaming")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "streaming",
        "host": platform.node(),
        "time": time.time(),
        "workload": WORKLOAD,
        "max_new_tokens": args.max_new,
        "versions": args.versions,
        "slots": args.slots,
        "runs": {},
    }
    t0 = time.time()
    keys = (
        "consumed_tokens_per_s",
        "generator_busy",
        "trainer_busy",
        "occupancy",
        "dropped_stale",
        "rejected_uniform",
        "stream_over_offline",
        "sampled_over_offline",
        "offline_spread",
        "step_share",
        "step_cpu_share",
    )
    for engine in [e for e in args.engines.split(",") if e]:
        runs = result["runs"].setdefault(engine, {})
        for name in VARIANTS:
            print(f"[bench] {engine} {name}: {args.versions} versions ...", flush=True)
            runs[name] = run_variant(engine, name, args, args.out)
            write_json(args.out / "streaming.json", result)  # after each run: a later failure keeps the figures
        runs["async_over_sync"] = runs["eta4_keep_kv"]["consumed_tokens_per_s"] / runs["eta0"]["consumed_tokens_per_s"]
        print(f"\n{engine:<8}{'variant':<19}" + "".join(f"{k:>22}" for k in keys))
        for name in VARIANTS:
            r = runs[name]
            print(f"{'':<8}{name:<19}" + "".join(f"{r[k]:>22.3f}" for k in keys))
        e4 = runs["eta4_keep_kv"]
        print(
            f"  async (eta=4) / sync (eta=0): {runs['async_over_sync']:.2f}x; eta=4 bottleneck: {e4['bottleneck']} "
            f"busy {e4['bottleneck_busy']:.1%}; streaming generator {e4['stream_sampled_tokens_per_busy_s']:.0f} "
            f"tokens/s per busy second = {e4['sampled_over_offline']:.1%} of offline "
            f"{e4['offline_gen_tokens_per_s']:.0f} ({e4['stream_over_offline']:.1%} counting only the stored "
            f"answers; the two offline measurements differ by {e4['offline_spread']:.1%}); inside engine steps "
            f"{e4['step_share']:.1%} of the generating time, with {e4['step_cpu_share']:.1%} of a core\n"
        )
    result["wall_s"] = time.time() - t0
    write_json(args.out / "streaming.json", result)
    print(f"wrote {args.out / 'streaming.json'}")


if __name__ == "__main__":
    main()
