"""Asynchronous vs synchronous RL on the same machine and config, under each weight-update mode: consumed
tokens/s for eta=0 and eta=4 with rollout.weight_update keep_kv, recompute and drain, and weight-sync
bandwidth against a raw single-buffer broadcast.

The workload makes generation and training cost about the same, with long-tailed generation lengths
as in reasoning: an untrained tiny model samples up to 128 tokens (EOS is one token in 18, so lengths
are roughly geometric with a long tail), B=16 groups of n=8, up to 32 groups (256 sequences) in flight,
and every group is trained on (no dynamic sampling). `cluster.pin_roles=true` gives the generator a core
of its own, as it has its own GPUs on a cluster. On the 4-token demo task training dominates and there is
little to overlap.

Every variant runs --repeats times, interleaved (one of each, then again), so that the host's drift
falls on every variant alike; the figures are the mean and the spread of the repeats. Throughput is given
twice: over the whole run (first publish to last version) and after --steady-after versions. A run's
first batch is generated with the trainer idle at any eta, so a short run understates what overlap
gains in a long one; the second figure leaves that start out.

    .venv/bin/python benchmarks/async_vs_sync.py --versions 60    # about 15 minutes on 2 cores
    .venv/bin/python benchmarks/async_vs_sync.py --engine vllm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _runs import (  # benchmarks/ is on the path when a benchmark runs as a script
    BASE_WORKLOAD,
    VARIANTS,
    WEIGHT_UPDATES,
    figures,
    launch_run,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

WORKLOAD = [
    *BASE_WORKLOAD,
    "rollout.max_new_tokens=128",
    "rollout.max_concurrent_groups=32",
    "logging.eval_prompts=20",
    "cluster.pin_roles=true",
]
KEYS = (
    "consumed_tokens_per_s",
    "steady_tokens_per_s",
    "generator_busy",
    "occupancy",
    "prefill_tokens_per_version",
    "group_wall_s_mean",
    "step_ms_mean",
    "rows_per_step_mean",
)


def steady_tokens_per_s(run_dir: Path, after: int) -> float:
    """Consumed tokens/s from version `after` to the last: the run without its start, where the first batch
    is generated with the trainer idle whatever eta is (a fixed cost that a run of hundreds of versions
    amortises, and a short one does not)."""
    import pandas as pd

    from areal_hpc.rundir import RunDir

    m = pd.read_csv(RunDir(run_dir).metrics).set_index("version")
    last = int(m.index.max())
    return float(m.loc[after + 1 : last, "tokens"].sum() / (m.loc[last, "wall_s"] - m.loc[after, "wall_s"]))


def run_variant(name: str, args, repeat: int) -> dict:
    run_dir = args.out / f"{args.engine}-{name}-{repeat}"
    overrides = [*WORKLOAD, *VARIANTS[name], f"trainer.versions={args.versions}", f"rollout.engine={args.engine}"]
    _, s = launch_run(run_dir, overrides, args.out / "model")
    keep = ("consumed_tokens_per_s", "rl_wall_s", "prefill_tokens", "aborted_requests", "dropped_stale")
    steady = steady_tokens_per_s(run_dir, args.steady_after)
    return {
        **{k: s[k] for k in keep},
        "steady_tokens_per_s": steady,
        **figures(run_dir, s),
        "sync_s_mean": s.get("sync_s_mean"),
    }


def weight_sync_figures(out_root: Path) -> dict:
    from areal_hpc.launch.environment import rank_env

    out = out_root / "weight_sync.json"
    cmd = ["mpirun", "-n", "3", "--oversubscribe", "--bind-to", "none", sys.executable]
    cmd += [str(ROOT / "benchmarks" / "_weight_sync_mpi.py"), str(out)]
    subprocess.run(cmd, env=rank_env(local_mpirun=True), check=True, capture_output=True, timeout=600)
    return json.loads(out.read_text())


# a single-threaded torch job pinned to one core: argv core, matmuls; prints its seconds
_SPIN = (
    "import os, sys, time, torch; os.sched_setaffinity(0, {int(sys.argv[1])}); torch.set_num_threads(1); "
    "a, b = torch.randn(256, 256), torch.randn(256, 2048); t = time.perf_counter(); "
    "[a @ b for _ in range(int(sys.argv[2]))]; print(time.perf_counter() - t)"
)


def host_parallelism(matmuls: int = 600) -> dict:
    """Two single-threaded torch jobs pinned to two cores, each alone and then both at once: the share of its
    solo speed each keeps when the other runs (1.0 = the cores share nothing: cache, memory bandwidth, a
    physical core under two virtual ones)."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        return {}

    def start(core: int):
        return subprocess.Popen(
            [sys.executable, "-c", _SPIN, str(core), str(matmuls)], stdout=subprocess.PIPE, text=True
        )

    alone = [float(start(c).communicate()[0]) for c in cores]
    procs = [start(c) for c in cores]
    together = [float(p.communicate()[0]) for p in procs]
    return {
        "alone_s": alone,
        "together_s": together,
        "parallel_efficiency": statistics.fmean(a / t for a, t in zip(alone, together, strict=True)),
    }


def async_ceiling(sync_runs: list[dict], efficiency: float) -> float:
    """The most async can gain over these synchronous runs here: a version can take no less than its busier
    role's share of the synchronous version (generation or training), slowed as two busy cores slow each other."""
    g = statistics.fmean(r["generator_busy"] for r in sync_runs)
    t = statistics.fmean(r["trainer_busy"] for r in sync_runs)
    return efficiency / max(g, t)


def summarise(runs: list[dict]) -> dict:
    """Mean of each figure over the repeats, and the relative spread of the throughput."""
    out = {k: statistics.fmean(r[k] for r in runs) for k in KEYS}
    tps = [r["consumed_tokens_per_s"] for r in runs]
    out["tokens_per_s_runs"] = tps
    out["spread"] = (max(tps) - min(tps)) / out["consumed_tokens_per_s"]
    steady = [r["steady_tokens_per_s"] for r in runs]
    out["steady_spread"] = (max(steady) - min(steady)) / out["steady_tokens_per_s"]
    return out


def main() -> None:
    from areal_hpc.utils import atomic_write_text

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=20, help="policy versions per run")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each variant, interleaved")
    ap.add_argument("--steady-after", type=int, default=6, help="the steady figure counts versions after this one")
    ap.add_argument("--engine", default="torch", choices=("torch", "vllm"), help="rollout.engine")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {', '.join(VARIANTS)}")
    ap.add_argument("--out", type=Path, default=RESULTS / "async_vs_sync")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in names if v not in VARIANTS]:
        ap.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names:
            print(f"[bench] {name} run {rep + 1}/{args.repeats}: {args.versions} versions ...", flush=True)
            runs[name].append(run_variant(name, args, rep))
    table = {n: summarise(r) for n, r in runs.items()}
    sync = weight_sync_figures(args.out)
    host = host_parallelism()

    print(f"\n{'variant':<18}" + "".join(f"{k:>28}" for k in KEYS) + f"{'spread':>10}")
    for name, r in table.items():
        print(f"{name:<18}" + "".join(f"{r[k]:>28.3f}" for k in KEYS) + f"{r['spread']:>10.1%}")
    ratios, steady = {}, {}
    if "eta0" in table:
        for mode in WEIGHT_UPDATES:
            if (name := f"eta4_{mode}") in table:
                ratios[mode] = table[name]["consumed_tokens_per_s"] / table["eta0"]["consumed_tokens_per_s"]
                steady[mode] = table[name]["steady_tokens_per_s"] / table["eta0"]["steady_tokens_per_s"]
                print(
                    f"async (eta=4, {mode:<9}) / sync (eta=0): {ratios[mode]:.2f}x the whole run,"
                    f" {steady[mode]:.2f}x after v{args.steady_after}"
                )
        if host:
            host["async_ceiling"] = async_ceiling(runs["eta0"], host["parallel_efficiency"])
            print(
                f"this host: two pinned torch jobs each keep {host['parallel_efficiency']:.0%} of their solo speed; "
                f"with eta=0's busy shares, async/sync can reach at most {host['async_ceiling']:.2f}x here"
            )
    print(
        f"weight sync, {sync['bytes'] / 1e6:.0f} MB to 2 generators: bucketed {sync['bucketed_gbps']:.2f} GB/s "
        f"({sync['buckets']} buckets), raw single buffer {sync['raw_gbps']:.2f} GB/s, "
        f"per tensor {sync['per_tensor_gbps']:.2f} GB/s"
    )
    result = {
        "benchmark": "async_vs_sync",
        "host": platform.node(),
        "time": time.time(),
        "wall_s": time.time() - t0,
        "workload": WORKLOAD,
        "engine": args.engine,
        "versions": args.versions,
        "repeats": args.repeats,
        "runs": runs,
        "table": table,
        "async_over_sync": ratios,
        "steady_after": args.steady_after,
        "async_over_sync_steady": steady,
        "weight_sync": sync,
        "host_parallelism": host,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"async_vs_sync_{args.engine}.json"
    atomic_write_text(path, json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
