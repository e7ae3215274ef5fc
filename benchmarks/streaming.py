"""Streaming generation on the real asynchronous runtime, for the torch and the vLLM engine: consumed
tokens/s, how busy each role is, how full the engine stays, and the generator's tokens/s against its
engine's own offline throughput on the same requests.

Workload: long-tailed lengths as in reasoning. An untrained tiny model samples up to --max-new tokens
(EOS is one token in 18, so lengths are roughly geometric with a long tail); 1 generator + 1 trainer,
every group trained on (no dynamic sampling). Variants: eta=0 (the synchronous baseline, same code),
eta=4 with interruption, eta=4 without. The engine gets --slots running sequences (4): generation is
then the scarce resource, as memory-bound decode is on GPUs. With many slots this tiny model generates
several times faster than one trainer trains, the trainer is the bottleneck, and the generator waits at
the staleness gate by design (`--slots 16` shows that regime).

The ceiling: after each run, the same engine (same slots, same thread count) generates the run's own
stored requests (each prompt with exactly its stored answer length, EOS ignored), all added at once and
stepped to completion with no runtime around it. On this 2-core machine the trainer shares the
generator's cache and memory bandwidth, so the ceiling is also measured with the run's own training
replayed beside it, for the share of the generating time the trainer was training: the loop's own
cost is the stream against that figure. Read both ceilings with this shared machine's drift in mind:
one engine's offline figure moved by up to 40% between measurements minutes apart (2026-12-02), more
than the effects measured here; compare variants over several runs.

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
import platform
import sys
import time
from pathlib import Path

from _runs import BASE_WORKLOAD, VARIANTS, launch_run  # benchmarks/ is on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from areal_hpc.rundir import RunDir  # noqa: E402 (after the path: runs from a checkout)

RESULTS = ROOT / "benchmarks" / "results"

WORKLOAD = [*BASE_WORKLOAD, "logging.eval_prompts=4"]


def _overlap(starts, ends, lo: float, hi: float) -> float:
    """Total length of the spans [start, end] inside [lo, hi]."""
    import numpy as np

    return float(np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None).sum())


def figures(run_dir: Path, summary: dict) -> dict:
    """Busy shares over the RL wall time, occupancy outside the first and last version, tokens per busy second."""
    import pandas as pd

    from areal_hpc.runtime.timeline import load_engine_samples, load_timeline
    from areal_hpc.store import load_trajectories

    tl = load_timeline(run_dir)
    # metrics.csv's clock origin (rank 0 starts it after loading the dataset, seconds after its timeline starts)
    t0 = summary["t0"]
    m = pd.read_csv(RunDir(run_dir).metrics).set_index("version")
    rl_lo, rl_hi = t0 + m.loc[0, "wall_s"], t0 + m["wall_s"].iloc[-1]  # first weights published -> last version trained
    out = {}
    for role, event in (("generator", "generate"), ("trainer", "train")):
        spans = tl[(tl.role == role) & (tl.event == event)]
        out[f"{role}_busy"] = _overlap(spans.t_start.to_numpy(), spans.t_end.to_numpy(), rl_lo, rl_hi) / (rl_hi - rl_lo)
    versions = m.index.max()
    lo, hi = t0 + m.loc[1, "wall_s"], t0 + m.loc[versions - 1, "wall_s"]  # outside the first and last version
    eng = load_engine_samples(run_dir)
    inside = _overlap(eng.t_start.to_numpy(), eng.t_end.to_numpy(), lo, hi)
    frac = ((eng.t_end.clip(upper=hi) - eng.t_start.clip(lower=lo)).clip(lower=0) / (eng.t_end - eng.t_start)).fillna(0)
    out["occupancy"] = float((eng.seq_s * frac).sum() / (eng.capacity.iloc[0] * (hi - lo)))
    out["occupancy_window_covered"] = inside / (hi - lo)
    gen_spans = tl[(tl.role == "generator") & (tl.event == "generate")]
    gen = gen_spans["duration"].sum()
    train_spans = tl[(tl.role == "trainer") & (tl.event == "train")]
    ts, te = train_spans.t_start.to_numpy(), train_spans.t_end.to_numpy()
    # the share of generating time the trainer was training beside it: the neighbour the loaded ceiling replays
    out["train_during_generate"] = (
        sum(_overlap(ts, te, a, b) for a, b in zip(gen_spans.t_start, gen_spans.t_end, strict=True)) / gen
    )
    trajs = load_trajectories(run_dir)
    out["generated_tokens"] = int(trajs["gen_len"].sum())
    out["stream_gen_tokens_per_busy_s"] = out["generated_tokens"] / gen
    out["stream_gen_tokens_per_rl_s"] = out["generated_tokens"] / summary["rl_wall_s"]
    # every token the engine sampled (one per running sequence per step): also the held-out evaluations
    # that share the stream and the partial answers dropped at the stop, which the stored count leaves out
    out["stream_sampled_tokens_per_busy_s"] = float(eng.seq_steps.sum()) / gen
    return out


def _replay_training(run_dir: str, model: str, duty: float, ready, stop) -> None:
    """The run's own PPO steps on its stored batches, busy `duty` of the time: the load the trainer put
    on the generator's neighbour core (shared cache and memory bandwidth on this 2-core machine)."""
    import numpy as np
    import torch

    from areal_hpc.algo.advantages import batch_advantages
    from areal_hpc.config import load_config
    from areal_hpc.runtime.build import build_train_engine
    from areal_hpc.store import list_shards, read_shard

    cfg = load_config(Path(run_dir) / "config.yaml", [])
    torch.set_num_threads(cfg.cluster.threads_per_rank)
    engine = build_train_engine(cfg, Path(model))
    trajs = [t for shard in list_shards(RunDir(run_dir).rollouts) for t in read_shard(shard)]
    per = cfg.rollout.batch_prompts * cfg.rollout.n_samples
    k = 0
    while not stop.is_set():
        batch = [trajs[(k * per + i) % len(trajs)] for i in range(per)]
        k += 1
        t = time.perf_counter()
        r = np.array([x.reward for x in batch], dtype=np.float64)
        adv, _ = batch_advantages(r, np.array([x.group_id for x in batch]), cfg.ppo.adv_norm, False)
        engine.ppo_update(batch, adv)
        ready.set()
        stop.wait((time.perf_counter() - t) * (1 - duty) / duty)


def offline_ceiling(engine: str, run_dir: Path, model: Path, cfg, neighbour_duty: float = 0.0) -> float:
    """The engine's own tokens/s on the run's stored requests: all added at once, stepped to completion.

    With `neighbour_duty` > 0 a second process replays the run's training beside it, busy that share
    of the time: the same neighbour the streaming generator had, so the two figures compare the loop alone.
    """
    import multiprocessing as mp

    import torch

    from areal_hpc.engines import make_generation_engine
    from areal_hpc.store import list_shards, read_shard
    from areal_hpc.types import GenRequest

    torch.set_num_threads(cfg.cluster.threads_per_rank)  # as the generator rank runs
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
    neighbour = None
    try:
        from areal_hpc.engines.base import generate

        if neighbour_duty > 0:
            ctx = mp.get_context("spawn")
            ready, stop = ctx.Event(), ctx.Event()
            args = (str(run_dir), str(model), min(neighbour_duty, 1.0), ready, stop)
            neighbour = ctx.Process(target=_replay_training, args=args, daemon=True)
            neighbour.start()
            if not ready.wait(300):
                raise RuntimeError("the training replay did not finish a step in 300 s")
        generate(eng, reqs[:8])  # warm-up
        t = time.perf_counter()
        outs = generate(eng, reqs)
        secs = time.perf_counter() - t
    finally:
        if neighbour is not None:
            stop.set()
            neighbour.join(60)
            if neighbour.is_alive():
                neighbour.kill()
        eng.close()
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
    r["offline_gen_tokens_per_s"] = offline_ceiling(engine, run_dir, out_root / "model", cfg)
    r["stream_over_offline"] = r["stream_gen_tokens_per_busy_s"] / r["offline_gen_tokens_per_s"]
    r["sampled_over_offline"] = r["stream_sampled_tokens_per_busy_s"] / r["offline_gen_tokens_per_s"]
    # the same ceiling with the run's training replayed beside it (none at eta=0: the roles take turns)
    duty = r["train_during_generate"]
    ceiling = offline_ceiling(engine, run_dir, out_root / "model", cfg, duty) if duty > 0.02 else None
    r["offline_loaded_gen_tokens_per_s"] = ceiling or r["offline_gen_tokens_per_s"]
    r["stream_over_loaded"] = r["stream_gen_tokens_per_busy_s"] / r["offline_loaded_gen_tokens_per_s"]
    r["sampled_over_loaded"] = r["stream_sampled_tokens_per_busy_s"] / r["offline_loaded_gen_tokens_per_s"]
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
        "train_during_generate",
        "stream_over_loaded",
        "sampled_over_loaded",
    )
    for engine in [e for e in args.engines.split(",") if e]:
        runs = result["runs"].setdefault(engine, {})
        for name in VARIANTS:
            print(f"[bench] {engine} {name}: {args.versions} versions ...", flush=True)
            runs[name] = run_variant(engine, name, args, args.out)
            write_json(args.out / "streaming.json", result)  # after each run: a later failure keeps the figures
        runs["async_over_sync"] = runs["eta4"]["consumed_tokens_per_s"] / runs["eta0"]["consumed_tokens_per_s"]
        print(f"\n{engine:<8}{'variant':<19}" + "".join(f"{k:>22}" for k in keys))
        for name in VARIANTS:
            r = runs[name]
            print(f"{'':<8}{name:<19}" + "".join(f"{r[k]:>22.3f}" for k in keys))
        e4 = runs["eta4"]
        print(
            f"  async (eta=4) / sync (eta=0): {runs['async_over_sync']:.2f}x; eta=4 bottleneck: {e4['bottleneck']} "
            f"busy {e4['bottleneck_busy']:.1%}; streaming generator {e4['stream_sampled_tokens_per_busy_s']:.0f} "
            f"tokens/s per busy second = {e4['sampled_over_offline']:.1%} of offline "
            f"{e4['offline_gen_tokens_per_s']:.0f} ({e4['stream_over_offline']:.1%} counting only the stored "
            f"answers); against the ceiling with the run's training replayed beside it "
            f"({e4['train_during_generate']:.0%} of the time), {e4['offline_loaded_gen_tokens_per_s']:.0f}: "
            f"{e4['sampled_over_loaded']:.1%} ({e4['stream_over_loaded']:.1%})\n"
        )
    result["wall_s"] = time.time() - t0
    write_json(args.out / "streaming.json", result)
    print(f"wrote {args.out / 'streaming.json'}")


if __name__ == "__main__":
    main()
