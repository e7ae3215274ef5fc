"""What the objective menu's terms cost the trainer: tokens/s and peak memory of a whole PPO version with a KL
term, an entropy bonus and GSPO's sequence ratios, against the plain decoupled objective, side by side.

The model is Qwen2-shaped with Qwen's real vocabulary (151,936), built locally with random weights (as
benchmarks/train_memory.py builds it). Each case is one `TorchTrainEngine.ppo_update` (the proximal recompute,
the reference forward where there is a KL, and the optimizer steps) over the same batch of long-tailed answers,
in a child process of its own so its peak resident memory (ru_maxrss) is its own. Cases run round-robin,
`--rounds` times, so a slow moment of the shared machine falls on every case alike; each case's ratio to
`plain` is taken within its round.

- `plain`: decoupled PPO (today's default objective);
- `kl`: + ppo.kl_coef (k3): a frozen reference copy of the weights and one more no-grad forward per version;
- `entropy`: + ppo.entropy_coef: the entropy's gradient through every logit of each chunk;
- `sequence`: ppo.importance=sequence (GSPO): a prepass of the output layer before the gradient pass;
- `all`: the three together.

The model's output layer is a far larger share of this small model's work than of a 1.5B or a 7B one, and the
sequence prepass repeats only the output layer: the script also prints that share, and the prepass's
share of a version's FLOPs at the 1.5B and 7B shapes (2 V H per token against ~6 N per token for forward and
backward, plus the forward of the proximal recompute).

    .venv/bin/python benchmarks/objective_cost.py                      # CPU, about 5 minutes
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

from train_memory import QWEN_VOCAB, build_model, lengths_for  # noqa: E402  (benchmarks/ is on the path)

from areal_hpc.utils import atomic_write_text  # noqa: E402

CASES = {
    "plain": {},
    "kl": {"kl_coef": 0.04},
    "entropy": {"entropy_coef": 0.001},
    "sequence": {"importance": "sequence"},
    "all": {"kl_coef": 0.04, "entropy_coef": 0.001, "importance": "sequence"},
}
# (hidden size, parameters) of the shapes the recipes train: Qwen2.5-1.5B and Qwen2.5-7B
SHAPES = {"1.5B": (1536, 1.54e9), "7B": (3584, 7.6e9)}


def batch(vocab: int, budget: int, seed: int = 0):
    from areal_hpc.types import Trajectory

    rng = np.random.default_rng(seed)
    trajs = []
    for i, n in enumerate(lengths_for("mixed", budget, seed)):
        prompt = min(64, n // 2)
        mask = np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.uint8)
        behav = np.where(mask > 0, -rng.uniform(0.5, 6.0, n), 0).astype(np.float32)
        ids = rng.integers(1, vocab, n).astype(np.int32)
        trajs.append(
            Trajectory(i // 4, i // 4, i % 4, ids, behav, np.where(mask > 0, 0, -1).astype(np.int32), mask, prompt)
        )
    return trajs, rng.standard_normal(len(trajs)).astype(np.float32)


def child(case: dict) -> dict:
    from areal_hpc.algo.ppo import Objective
    from areal_hpc.engines.torch_train import TorchTrainEngine

    torch.set_num_threads(case["threads"])
    engine = TorchTrainEngine(
        case["model"],
        objective=Objective(behav_cap=5.0, **case["objective"]),
        loss_agg="seq_mean_token_mean" if case["objective"].get("importance") == "sequence" else "token_mean",
        max_tokens_per_mb=case["mb_tokens"],
        logprob_chunk_tokens=case["chunk"],
        n_minibatches=2,
        lr=1e-6,
    )
    small, small_adv = batch(engine.model.config.vocab_size, 512, seed=1)
    engine.ppo_update(small, small_adv)  # warm-up: allocator pools; the reference is built here
    trajs, adv = batch(engine.model.config.vocab_size, case["tokens"])
    seconds = []
    for _ in range(case["repeats"]):
        t0 = time.perf_counter()
        engine.ppo_update(trajs, adv)
        seconds.append(time.perf_counter() - t0)
    tokens = int(sum(len(t.input_ids) for t in trajs))
    return {
        "seconds": statistics.fmean(seconds),
        "tokens": tokens,
        "tokens_per_s": tokens / statistics.fmean(seconds),
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "params": sum(p.numel() for p in engine.model.parameters()),
    }


def run_case(case: dict) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(case)], capture_output=True, text=True, timeout=3600
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"case {case['name']} failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return {**case, **json.loads(lines[-1])}


def prepass_share(hidden: int, params: float, vocab: int = QWEN_VOCAB) -> float:
    """FLOPs of the sequence prepass (one more output-layer projection) over those of a version's step per token:
    the proximal recompute (forward, 2 N) and the training forward and backward (6 N)."""
    return 2 * vocab * hidden / (8 * params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the batch (long-tailed answers)")
    ap.add_argument("--mb-tokens", type=int, default=4096, help="trainer.max_tokens_per_mb")
    ap.add_argument("--chunk", type=int, default=256, help="trainer.logprob_chunk_tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timed versions per case and round")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "objective_cost.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "model", args))
        runs = []
        for rnd in range(args.rounds):
            for name, objective in CASES.items():
                case = dict(name=name, objective=objective, model=model, round=rnd, threads=args.threads)
                case |= dict(tokens=args.tokens, mb_tokens=args.mb_tokens, chunk=args.chunk, repeats=args.repeats)
                runs.append(run_case(case))
                r = runs[-1]
                print(
                    f"[objective cost] round {rnd} {name:<9} {r['tokens_per_s']:8.0f} tok/s"
                    f"  peak {r['peak_gib']:.2f} GiB",
                    flush=True,
                )
    plain = {r["round"]: r for r in runs if r["name"] == "plain"}
    params = runs[0]["params"]
    rows = []
    for name in CASES:
        mine = [r for r in runs if r["name"] == name]
        speed = [r["tokens_per_s"] / plain[r["round"]]["tokens_per_s"] for r in mine]
        rows.append(
            {
                "case": name,
                "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in mine),
                "vs_plain": statistics.fmean(speed),
                "vs_plain_spread": [min(speed), max(speed)],
                "peak_gib": statistics.fmean(r["peak_gib"] for r in mine),
                "peak_vs_plain_gib": statistics.fmean(r["peak_gib"] - plain[r["round"]]["peak_gib"] for r in mine),
            }
        )
    head_share = QWEN_VOCAB * args.hidden / params
    print(f"\n{'case':<10}{'tokens/s':>10}{'vs plain':>10}{'spread':>16}{'peak GiB':>10}{'+ GiB':>8}")
    for r in rows:
        lo, hi = r["vs_plain_spread"]
        print(
            f"{r['case']:<10}{r['tokens_per_s']:>10.0f}{r['vs_plain']:>10.3f}{f'{lo:.3f}-{hi:.3f}':>16}"
            f"{r['peak_gib']:>10.2f}{r['peak_vs_plain_gib']:>8.2f}"
        )
    print(f"this model: {params / 1e6:.0f}M parameters, the output layer {100 * head_share:.0f}% of them")
    shares = {k: prepass_share(h, p) for k, (h, p) in SHAPES.items()}
    print(
        "the sequence prepass's share of a version's FLOPs: "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items())
    )
    result = {
        "benchmark": "objective_cost",
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
        "rows": rows,
        "runs": runs,
        "output_layer_share": head_share,
        "prepass_flop_share": shares,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
