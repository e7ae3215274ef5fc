"""Asynchronous vs synchronous RL on the same machine and config: consumed tokens/s for eta=0 and eta=4,
interruptible generation on vs off, and weight-sync bandwidth against a raw single-buffer broadcast.

The workload makes generation and training cost about the same, with long-tailed generation lengths
as in reasoning: an untrained tiny model samples up to 128 tokens (EOS is one token in 18, so lengths
are roughly geometric with a long tail), and every group is trained on (no dynamic sampling). On the
4-token demo task training dominates and there is little to overlap.

    .venv/bin/python benchmarks/async_vs_sync.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from _runs import BASE_WORKLOAD, VARIANTS, launch_run  # benchmarks/ is on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

WORKLOAD = [*BASE_WORKLOAD, "rollout.max_new_tokens=128", "rollout.max_concurrent_groups=32", "logging.eval_prompts=20"]


def busy_fractions(run_dir: Path) -> dict[str, float]:
    """Share of RL wall time each role spent in its real work (generate / train)."""
    from areal_hpc.runtime.timeline import load_timeline

    tl = load_timeline(run_dir)
    t0, t1 = tl["t_start"].min(), tl["t_end"].max()
    gen = tl[(tl.role == "generator") & (tl.event == "generate")]["duration"].sum()
    train = tl[(tl.role == "trainer") & (tl.event == "train")]["duration"].sum()
    return {"generator_busy": gen / (t1 - t0), "trainer_busy": train / (t1 - t0)}


def run_variant(name: str, versions: int, out_root: Path) -> dict:
    run_dir = out_root / name
    _, s = launch_run(run_dir, [*WORKLOAD, *VARIANTS[name], f"trainer.versions={versions}"], out_root / "model")
    return {**s, **busy_fractions(run_dir)}


def weight_sync_figures(out_root: Path) -> dict:
    from areal_hpc.launch.environment import rank_env

    out = out_root / "weight_sync.json"
    cmd = [
        "mpirun",
        "-n",
        "3",
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        str(ROOT / "benchmarks" / "_weight_sync_mpi.py"),
        str(out),
    ]
    subprocess.run(cmd, env=rank_env(local_mpirun=True), check=True, capture_output=True, timeout=600)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=25, help="policy versions per variant")
    ap.add_argument("--out", type=Path, default=RESULTS / "async_vs_sync")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    runs = {}
    for name in VARIANTS:
        print(f"[bench] {name}: {args.versions} versions ...", flush=True)
        runs[name] = run_variant(name, args.versions, args.out)
    sync = weight_sync_figures(args.out)

    keys = (
        "consumed_tokens_per_s",
        "rl_wall_s",
        "generator_busy",
        "trainer_busy",
        "sync_gbps_mean",
        "raw_broadcast_gbps",
    )
    print(f"\n{'variant':<20}" + "".join(f"{k:>22}" for k in keys))
    for name, r in runs.items():
        print(f"{name:<20}" + "".join(f"{(r[k] if r[k] is not None else float('nan')):>22.3f}" for k in keys))
    ratio = runs["eta4"]["consumed_tokens_per_s"] / runs["eta0"]["consumed_tokens_per_s"]
    interrupt_gain = runs["eta4"]["consumed_tokens_per_s"] / runs["eta4_no_interrupt"]["consumed_tokens_per_s"]
    print(f"\nasync (eta=4) / sync (eta=0) throughput: {ratio:.2f}x")
    print(f"interrupt on / off (eta=4):             {interrupt_gain:.2f}x")
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
        "versions": args.versions,
        "runs": runs,
        "async_over_sync": ratio,
        "interrupt_on_over_off": interrupt_gain,
        "weight_sync": sync,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "async_vs_sync.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {RESULTS / 'async_vs_sync.json'}")


if __name__ == "__main__":
    main()
