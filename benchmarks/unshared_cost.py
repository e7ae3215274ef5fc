"""What `trainer.share_prefixes` costs a micro-batch that shares nothing: share on against off, side by side.

Sequences whose prompts are below `trainer.share_min_tokens` (or all different) have nothing to lay down once,
and a micro-batch of them should cost what it cost before sharing existed. Per micro-batch this times what a
trainer's PPO step runs: the micro-batches planned (`Batching.plan`), each one built (`Batching.build`), its
forward and the loss's chunked head (`forward.chunked_loss`), and its backward. One model serves both arms, its
attention switched the way each trainer switches it (`forward.use_packed_attention`, trees for share on); the
arms alternate, `--rounds` times each, after one warm-up round; figures are medians over the rounds (and the
fastest round, the least disturbed on a shared machine).

Cases (random tokens: the cost does not depend on them):
- `demo`: the long-tailed async/sync workload (benchmarks/async_vs_sync.py): groups of 8 answers to a 7-token
  prompt, answer lengths geometric with mean 18 and at most 128, 32 sequences per minibatch;
- `distinct`: 8 sequences with a 200-token prompt each, all different, and 300-token answers.

    .venv/bin/python benchmarks/unshared_cost.py                  # CPU, about a minute
    .venv/bin/python benchmarks/unshared_cost.py --device cuda --bf16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a bare checkout too

from areal_hpc.engines import forward  # noqa: E402
from areal_hpc.engines.batching import Batching  # noqa: E402
from areal_hpc.utils import atomic_write_text  # noqa: E402

MIN_SHARED = 32  # trainer.share_min_tokens' default


def sequences(case: str, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if case == "demo":
        out = []
        for _ in range(4):  # 4 groups of 8: one minibatch of the demo's 16 groups split 4 ways
            prompt = rng.integers(1, vocab, 7)
            for _ in range(8):
                answer = rng.integers(1, vocab, int(min(128, rng.geometric(1 / 18))))
                out.append(np.concatenate([prompt, answer]))
        return out
    if case == "distinct":
        return [rng.integers(1, vocab, 500) for _ in range(8)]
    raise ValueError(f"unknown case {case!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_arm(model, seqs: list[np.ndarray], share: bool, args, device: torch.device) -> dict:
    """One round of one arm: seconds per micro-batch for the whole step and for its bookkeeping alone."""
    forward.use_packed_attention(model, device, half=args.bf16, trees=share)
    batching = Batching(args.mb_tokens, True, share, MIN_SHARED, 0, device)
    head = model.get_output_embeddings()
    n_tokens = float(sum(len(s) for s in seqs))

    def loss_fn(lp, index):
        return -lp.sum() / n_tokens

    _sync(device)
    t0 = time.perf_counter()
    plan = batching.plan(seqs)
    mbs = [batching.build([seqs[i] for i in m]) for m in plan]
    _sync(device)
    t_built = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
        for mb in mbs:
            loss, _, _ = forward.chunked_loss(model, head, mb, loss_fn, chunk_tokens=args.chunk)
            loss.backward()
    _sync(device)
    t_end = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return {
        "step_s": (t_end - t0) / len(mbs),
        "bookkeeping_s": (t_built - t0) / len(mbs),
        "micro_batches": len(mbs),
        "trees": sum(mb.tree is not None for mb in mbs),
        "positions": sum(mb.positions for mb in mbs),
    }


def demo_model(work: Path) -> str:
    from areal_hpc.config import load_config
    from areal_hpc.model import ensure_model

    cfg = load_config(ROOT / "jobs" / "demo.yaml", [f"model.path={work / 'demo'}"])
    return str(ensure_model(cfg.model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["demo", "distinct"], choices=["demo", "distinct"])
    ap.add_argument("--model", help="a model folder (default: jobs/demo.yaml's tiny Llama, built here)")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds of each arm, alternating")
    ap.add_argument("--mb-tokens", type=int, default=4096, help="trainer.max_tokens_per_mb (both arms)")
    ap.add_argument("--chunk", type=int, default=256, help="trainer.logprob_chunk_tokens")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true", help="autocast to bf16 (trainer.bf16)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "unshared_cost.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    from areal_hpc.model import load_causal_lm

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = load_causal_lm(args.model or demo_model(Path(tmp))).to(device).train()
        for case in args.cases:
            seqs = sequences(case, model.config.vocab_size)
            got: dict[bool, list[dict]] = {False: [], True: []}
            for r in range(args.rounds + 1):
                for share in (False, True):
                    res = time_arm(model, seqs, share, args, device)
                    if r:  # round 0 warms both arms up (allocator pools, kernels)
                        got[share].append(res)
            row: dict = {"case": case, "sequences": len(seqs), "tokens": int(sum(len(s) for s in seqs))}
            for share, key in ((False, "off"), (True, "on")):
                runs = got[share]
                row[f"{key}_ms_per_mb"] = 1e3 * statistics.median(x["step_s"] for x in runs)
                row[f"{key}_ms_per_mb_min"] = 1e3 * min(x["step_s"] for x in runs)  # the least disturbed round
                row[f"{key}_bookkeeping_ms_per_mb"] = 1e3 * statistics.median(x["bookkeeping_s"] for x in runs)
                row[f"{key}_micro_batches"] = runs[-1]["micro_batches"]
                row[f"{key}_tree_micro_batches"] = runs[-1]["trees"]
                row[f"{key}_positions"] = runs[-1]["positions"]
            row["on_over_off"] = row["on_ms_per_mb"] / row["off_ms_per_mb"]
            rows.append(row)
            print(
                f"{case:<9} {row['off_micro_batches']} micro-batch(es) of {row['tokens']} tokens: "
                f"fwd+bwd {row['off_ms_per_mb']:.2f} ms off, {row['on_ms_per_mb']:.2f} ms on "
                f"({row['on_over_off']:.3f}x; fastest rounds {row['off_ms_per_mb_min']:.2f} and "
                f"{row['on_ms_per_mb_min']:.2f} ms); bookkeeping {row['off_bookkeeping_ms_per_mb']:.2f} -> "
                f"{row['on_bookkeeping_ms_per_mb']:.2f} ms; tree micro-batches with share on: "
                f"{row['on_tree_micro_batches']}",
                flush=True,
            )
    result = {
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
