"""What the objective menu's terms cost the trainer: tokens/s and peak memory of a whole PPO version with a KL
term, an entropy bonus and GSPO's sequence ratios, against the plain decoupled objective, side by side.

The model is Qwen2-shaped with Qwen's real vocabulary (151,936), built locally with random weights (as
benchmarks/train_memory.py builds it). A case is one `TorchTrainEngine.ppo_update` (the proximal recompute,
the reference forward where there is a KL, and the optimizer steps) over the same batch of long-tailed
answers. Timing: one engine takes every objective in turn, `--rounds` times round-robin, so a slow moment
of the shared machine falls on every case alike, and each case's ratio to `plain` is taken within a round.
Memory: each case once more in a child process of its own, whose peak resident memory (ru_maxrss) is its own.

- `plain`: decoupled PPO (today's default objective);
- `kl`: + ppo.kl_coef (k3): a frozen reference copy of the weights and one more no-grad forward per version;
- `entropy`: + ppo.entropy_coef: the entropy's gradient through every logit of each chunk;
- `sequence`: ppo.importance=sequence (GSPO): a prepass of the output layer before the gradient pass;
- `all`: the three together.

The model's output layer is a far larger share of this small model's work than of a 1.5B or a 7B one, and the
sequence prepass repeats only the output layer: the script also prints that share, and the prepass's
share of a version's FLOPs at the 1.5B and 7B shapes (2 V H per token against ~6 N per token for forward and
backward, plus the forward of the proximal recompute).

    .venv/bin/python benchmarks/objective_cost.py                      # CPU, about 8 minutes
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


def _engine(case: dict, objective: dict):
    from areal_hpc.algo.ppo import Objective
    from areal_hpc.engines.torch_train import TorchTrainEngine

    torch.set_num_threads(case["threads"])
    return TorchTrainEngine(
        case["model"],
        objective=Objective(behav_cap=5.0, **objective),
        loss_agg="seq_mean_token_mean" if objective.get("importance") == "sequence" else "token_mean",
        max_tokens_per_mb=case["mb_tokens"],
        logprob_chunk_tokens=case["chunk"],
        n_minibatches=2,
        lr=1e-6,
    )


def _use(engine, objective: dict) -> None:
    """Switch a built engine to another objective (the reference is built on the first update with a KL)."""
    from areal_hpc.algo.ppo import Objective

    engine.objective = Objective(behav_cap=5.0, **objective)
    engine.loss_agg = "seq_mean_token_mean" if objective.get("importance") == "sequence" else "token_mean"


def child(case: dict) -> dict:
    """Timing (`case["timing"]`): every objective in turn on one engine, round-robin, each version timed.
    Memory: one objective's warm-up and one version in a process of its own; its peak resident memory."""
    if case["timing"]:
        engine = _engine(case, {})
        trajs, adv = batch(engine.model.config.vocab_size, case["tokens"])
        for objective in CASES.values():  # warm-up: allocator pools, the reference
            _use(engine, objective)
            engine.ppo_update(*batch(engine.model.config.vocab_size, 512, seed=1))
        seconds: dict[str, list[float]] = {name: [] for name in CASES}
        for _ in range(case["rounds"]):
            for name, objective in CASES.items():
                _use(engine, objective)
                t0 = time.perf_counter()
                engine.ppo_update(trajs, adv)
                seconds[name].append(time.perf_counter() - t0)
        tokens = int(sum(len(t.input_ids) for t in trajs))
        return {"tokens": tokens, "seconds": seconds, "params": sum(p.numel() for p in engine.model.parameters())}
    engine = _engine(case, case["objective"])
    engine.ppo_update(*batch(engine.model.config.vocab_size, 512, seed=1))
    engine.ppo_update(*batch(engine.model.config.vocab_size, case["tokens"]))
    return {"peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run_case(case: dict) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(case)], capture_output=True, text=True, timeout=3600
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"objective cost failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def prepass_share(hidden: int, params: float, vocab: int = QWEN_VOCAB) -> float:
    """FLOPs of the sequence prepass (one more output-layer projection) over those of a version's step per token:
    the proximal recompute (forward, 2 N) and the training forward and backward (6 N)."""
    return 2 * vocab * hidden / (8 * params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the batch (long-tailed answers)")
    ap.add_argument("--mb-tokens", type=int, default=4096, help="trainer.max_tokens_per_mb")
    ap.add_argument("--chunk", type=int, default=256, help="trainer.logprob_chunk_tokens")
    ap.add_argument("--rounds", type=int, default=3, help="timed versions of each objective, round-robin")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "objective_cost.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "model", args))
        base = dict(model=model, threads=args.threads, tokens=args.tokens, mb_tokens=args.mb_tokens, chunk=args.chunk)
        print(f"[objective cost] timing {len(CASES)} objectives x {args.rounds} rounds on one engine ...", flush=True)
        timing = run_case({**base, "timing": True, "rounds": args.rounds})
        peaks = {}
        for name, objective in CASES.items():
            peaks[name] = run_case({**base, "timing": False, "objective": objective})["peak_gib"]
            print(f"[objective cost] {name:<9} peak {peaks[name]:.2f} GiB", flush=True)
    secs, tokens, params = timing["seconds"], timing["tokens"], timing["params"]
    rows = []
    for name in CASES:
        speed = [p / s for p, s in zip(secs["plain"], secs[name], strict=True)]  # within each round
        rows.append(
            {
                "case": name,
                "tokens_per_s": tokens / statistics.fmean(secs[name]),
                "vs_plain": statistics.fmean(speed),
                "vs_plain_spread": [min(speed), max(speed)],
                "peak_gib": peaks[name],
                "peak_vs_plain_gib": peaks[name] - peaks["plain"],
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
        "seconds": secs,
        "output_layer_share": head_share,
        "prepass_flop_share": shares,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
