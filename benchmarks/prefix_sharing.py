"""Trainer time per version and peak memory with shared prefixes laid down once, against computing them per sequence.

One version is what `TorchTrainEngine.ppo_update` runs: the proximal recompute over the batch, then the PPO steps
(`--minibatches`), on trajectories of a fixed shape (random tokens: the cost does not depend on them):

- `math`: a group of 8 answers of 1,000-2,000 tokens (a seeded draw) to one 200-token prompt;
- `agent`: 8 episodes opening with the same 4,000-token preamble (a system prompt and tool descriptions),
  each going on for 300 tokens;
- `multi_turn`: the two-turn workflow's branches: 4 episodes of a 200-token prompt, a 400-token first answer
  and 30 tokens of feedback, each branching into 2 second answers of 300 tokens.

Models: `demo` (jobs/demo.yaml's tiny Llama, 2 layers, hidden 128, its 20-token vocabulary) and `bench`
(the Qwen2-shaped model of benchmarks/objective_cost.py: Qwen's 151,936 vocabulary, hidden 512, 4 layers, 99M
parameters, random weights). Each arm (model, case, shared or not) runs in a child process of its own, so its
peak resident memory (ru_maxrss) is its own; the arms are interleaved, `--rounds` times each, and the timed
versions follow one warm-up version in every child. Times are medians over the rounds.

    .venv/bin/python benchmarks/prefix_sharing.py               # CPU, about 20 minutes
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a bare checkout too
sys.path.insert(0, str(ROOT / "benchmarks"))

from areal_hpc.types import Trajectory  # noqa: E402
from areal_hpc.utils import atomic_write_text  # noqa: E402


def shapes(case: str, rng: np.random.Generator) -> list[tuple[list[int], int]]:
    """Each sequence as (the ids of the shared pieces it opens with, its own length), a piece's tokens drawn once."""
    if case == "math":
        return [([0], int(rng.integers(1000, 2001))) for _ in range(8)]
    if case == "agent":
        return [([1], 300) for _ in range(8)]
    if case == "multi_turn":
        return [([0, 10 + e], 300) for e in range(4) for _ in range(2)]
    raise ValueError(f"unknown case {case!r}")


PIECES = {0: 200, 1: 4000}  # piece id -> length; 10 + e: episode e's first answer and feedback (430)


def trajectories(case: str, vocab: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    pieces: dict[int, np.ndarray] = {}
    out = []
    for s, (head, own) in enumerate(shapes(case, rng)):
        for p in head:
            if p not in pieces:
                pieces[p] = rng.integers(1, vocab, PIECES.get(p, 430))
        ids = np.concatenate([*(pieces[p] for p in head), rng.integers(1, vocab, own)]).astype(np.int32)
        mask = np.zeros(len(ids), np.uint8)
        mask[len(pieces[head[0]]) :] = 1  # after the prompt: trained (the feedback too, for simplicity)
        behav = np.where(mask > 0, -rng.uniform(0.5, 3.0, len(ids)), 0).astype(np.float32)
        versions = np.where(mask > 0, 0, -1).astype(np.int32)
        out.append(Trajectory(0, 0, s, ids, behav, versions, mask, len(pieces[head[0]])))
    return out


def child(arm: dict) -> dict:
    """One arm in this process: a warm-up version, then `versions` timed ones."""
    from areal_hpc.engines.torch_train import TorchTrainEngine

    torch.set_num_threads(arm["threads"])
    engine = TorchTrainEngine(
        arm["model"],
        lr=1e-6,
        max_tokens_per_mb=arm["mb_tokens"],
        n_minibatches=arm["minibatches"],
        logprob_chunk_tokens=arm["chunk"],
        share_prefixes=arm["share"],
        seed=0,
    )
    trajs = trajectories(arm["case"], engine.model.config.vocab_size)
    adv = np.linspace(-1, 1, len(trajs)).astype(np.float32)
    everything = [list(range(len(trajs)))]
    minibatches = everything * arm["minibatches"]  # the whole group in each step: as the scheduler keeps groups
    engine.ppo_update(trajs[:2], adv[:2], [[0, 1]] * arm["minibatches"])  # warm-up: allocator pools, kernels
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds, stats = [], {}
    for _ in range(arm["versions"]):
        t0 = time.perf_counter()
        stats = engine.ppo_update(trajs, adv, minibatches)
        seconds.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seconds": seconds,
        "peak_gib": peak / 2**20,
        "before_gib": before / 2**20,
        "computed": stats["train_tokens_computed"],
        "unshared": stats["train_tokens_unshared"],
    }


def run_arm(arm: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps(arm)], capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"arm {arm['model_name']} {arm['case']} share={arm['share']} failed: {r.stderr[-2000:]}")
    return json.loads(lines[-1])


def models(work: Path, which: list[str]) -> dict[str, str]:
    out = {}
    if "demo" in which:
        from areal_hpc.config import load_config
        from areal_hpc.model import ensure_model

        cfg = load_config(ROOT / "jobs" / "demo.yaml", [f"model.path={work / 'demo'}"])
        out["demo"] = str(ensure_model(cfg.model))
    if "bench" in which:
        from train_memory import build_model

        out["bench"] = str(build_model(work / "bench", argparse.Namespace(hidden=512, layers=4, heads=8)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["demo", "bench"], choices=["demo", "bench"])
    ap.add_argument("--cases", nargs="+", default=["math", "agent", "multi_turn"])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of each arm")
    ap.add_argument("--versions", type=int, default=1, help="timed versions per arm and round")
    ap.add_argument("--minibatches", type=int, default=1, help="ppo.n_minibatches: optimizer steps per version")
    ap.add_argument("--mb-tokens", type=int, default=16384, help="trainer.max_tokens_per_mb (both arms)")
    ap.add_argument("--chunk", type=int, default=256, help="trainer.logprob_chunk_tokens")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefix_sharing.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in models(Path(tmp), args.models).items():
            for case in args.cases:
                arm = {
                    "model": path,
                    "model_name": name,
                    "case": case,
                    "mb_tokens": args.mb_tokens,
                    "minibatches": args.minibatches,
                    "chunk": args.chunk,
                    "versions": args.versions,
                    "threads": args.threads,
                }
                got: dict[bool, list[dict]] = {False: [], True: []}
                for _ in range(args.rounds):
                    for share in (False, True):  # interleaved: both arms see the same machine load
                        got[share].append(run_arm(arm | {"share": share}))
                row = {"model": name, "case": case}
                for share, key in ((False, "unshared"), (True, "shared")):
                    runs = got[share]
                    row[f"{key}_s"] = statistics.median(s for r in runs for s in r["seconds"])
                    row[f"{key}_peak_gib"] = max(r["peak_gib"] for r in runs)
                    row[f"{key}_tokens"] = runs[-1]["computed"]
                row["speedup"] = row["unshared_s"] / row["shared_s"]
                row["peak_ratio"] = row["shared_peak_gib"] / row["unshared_peak_gib"]
                rows.append(row)
                print(
                    f"{name:<6}{case:<12} tokens {row['unshared_tokens']:>7} -> {row['shared_tokens']:>7}   "
                    f"s/version {row['unshared_s']:8.2f} -> {row['shared_s']:8.2f} ({row['speedup']:.2f}x)   "
                    f"peak GiB {row['unshared_peak_gib']:.2f} -> {row['shared_peak_gib']:.2f}",
                    flush=True,
                )
    result = {
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "child")},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
