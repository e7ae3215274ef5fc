"""Peak memory and tokens/s of one training micro-batch: today's padded path against the packed, chunked one.

The model is Qwen2-shaped with Qwen's real vocabulary (151,936), built locally with random weights and few
layers so it fits this machine. Each case is one forward and backward of a PPO-style loss over one
micro-batch, in a child process of its own, so its peak resident memory (ru_maxrss) is its own; on a GPU
the figure is torch.cuda.max_memory_allocated. Cases side by side, in one run:

- `padded`: before this change: right padding to the longest sequence, transformers' sdpa with the padding
  mask, the full logits, an fp32 copy, a division by the temperature (another copy), log_softmax (a third);
- `packed`: padding-free packing, the loss and its gradient taken `--chunk` positions at a time, as the
  trainers run it (engines/forward.py);
- `packed` with `--big-chunk`: the same with bigger chunks; the two peaks give the memory per chunk
  position, hence the logits' share of the peak at `--chunk`. (Not a tiny chunk against none: buffers
  under glibc's mmap threshold, 32 MB at most, stay in the heap and the peak RSS stops meaning tensors.)

`--checkpointing` and `--bf16` apply to both paths (the code before had neither).

Micro-batches: `mixed` lengths (long-tailed, filling the budget) at each budget, and `equal` lengths
(four of budget/4) for the tokens/s comparison. A child over `--mem-limit-gib` fails and is reported as
out of memory (it cannot run), not killed by the kernel.

    .venv/bin/python benchmarks/train_memory.py                  # CPU, about 12 minutes
    python3 benchmarks/train_memory.py --device cuda --bf16 --hidden 1536 --layers 28 --heads 12 --budgets 32768 \
        --engine deepspeed --optimizer-step --checkpointing --mem-limit-gib 0    # as benchmarks/gpu_check.sh
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a bare checkout too

from areal_hpc.engines import forward  # noqa: E402
from areal_hpc.utils import atomic_write_text  # noqa: E402

QWEN_VOCAB = 151_936


def build_model(out: Path, args) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=QWEN_VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 35 // 6,  # Qwen2.5-1.5B's ratio (8960 / 1536)
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 6),  # grouped-query attention, as Qwen2.5-1.5B (12 / 2)
        max_position_embeddings=65536,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out, safe_serialization=True)
    return out


def lengths_for(kind: str, budget: int, seed: int = 0) -> list[int]:
    if kind == "equal":
        return [budget // 4] * 4
    rng = np.random.default_rng(seed)  # long-tailed: most answers short, a few near the budget's half
    out: list[int] = []
    while sum(out) < budget:
        n = int(np.clip(rng.lognormal(np.log(budget / 16), 1.0), 32, budget // 2))
        out.append(min(n, budget - sum(out)))
    return [n for n in out if n >= 2]


def padded_logprobs(engine, seqs):
    """Before this change (TorchTrainEngine._token_logprobs), kept here to measure against."""
    mb = forward.padded(seqs, engine.pad_token_id, engine.device)
    logits = engine._fwd(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float()
    logits = logits / engine.temperature
    lp = torch.log_softmax(logits, dim=-1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    return [lp[i, : len(s)] for i, s in enumerate(seqs)], mb


def child(case: dict) -> dict:
    """One case, in this process: load, warm up on a small batch, then one timed micro-batch."""
    if case["mem_limit_gib"] > 0:  # never on a GPU: CUDA reserves far more address space than it uses
        limit = int(case["mem_limit_gib"] * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(case["threads"])
    cuda = case["device"] == "cuda"
    kwargs = dict(
        device=case["device"],
        bf16=case["bf16"],
        logprob_chunk_tokens=case["chunk"],
        gradient_checkpointing=case["checkpointing"],
        max_tokens_per_mb=max(case["budget"], 1),
        packing=case["path"] == "packed",  # padded: transformers' own sdpa with the padding mask, as before
    )
    if case["engine"] == "deepspeed":
        from areal_hpc.engines.deepspeed_train import DeepSpeedTrainEngine

        engine = DeepSpeedTrainEngine(case["model"], zero_stage=case["zero_stage"], **kwargs)
    else:
        from areal_hpc.engines.torch_train import TorchTrainEngine

        engine = TorchTrainEngine(case["model"], **kwargs)
    rng = np.random.default_rng(1)
    vocab = engine.model.config.vocab_size

    def step(lengths):
        seqs = [rng.integers(1, vocab, size=n) for n in lengths]
        coef = torch.as_tensor(rng.standard_normal(sum(lengths)), dtype=torch.float32) / sum(lengths)
        engine.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if case["path"] == "padded":
            with torch.autocast(engine.device.type, dtype=torch.bfloat16, enabled=case["bf16"]):
                lps, mb = padded_logprobs(engine, seqs)
            loss = (torch.cat(lps) * coef.to(engine.device)).sum()
        else:  # what TorchTrainEngine.ppo_update runs: a per-token loss, its gradient taken chunk by chunk
            mb = forward.packed(seqs, engine.device)
            loss = engine._loss(seqs, lambda lp, index: (lp * coef.to(lp.device)[index]).sum())[0]
        engine._backward(loss, True)  # DeepSpeed: its backward (bf16, ZeRO gradient partitioning)
        if case["step"]:
            engine._optimizer_step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, mb

    step([64, 32])  # warm-up: allocator pools, kernels
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()
    try:
        seconds, mb = step(case["lengths"])
    except (RuntimeError, MemoryError) as err:
        if "memory" not in str(err).lower() and not isinstance(err, MemoryError):
            raise
        return {"status": "out of memory", "error": str(err).splitlines()[0][:200]}
    out = {
        "status": "ok",
        "seconds": seconds,
        "tokens": int(sum(case["lengths"])),
        "tokens_per_s": sum(case["lengths"]) / seconds,
        "padding_frac": mb.padding / mb.positions,
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "before_step_gib": base_kib / 2**20,
    }
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["before_step_gib"] = base_gpu / 2**30
    return out


def run_case(case: dict) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(case)], capture_output=True, text=True, timeout=3600
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        status = "killed (out of memory)" if r.returncode in (-9, 137) else f"failed: {tail[:200]}"
        return {**case, "status": status}
    return {**case, **json.loads(lines[-1])}


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute on fp32 weights (both paths)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048, 8192, 16384], help="tokens per micro-batch")
    ap.add_argument("--equal-budget", type=int, default=8192, help="the equal-length tokens/s case (0: none)")
    ap.add_argument("--chunk", type=int, default=256, help="trainer.logprob_chunk_tokens of the packed path")
    ap.add_argument("--big-chunk", type=int, default=1024, help="a second chunk size, for the logits' share (0: none)")
    ap.add_argument("--engine", choices=["torch", "deepspeed"], default="torch")
    ap.add_argument("--zero-stage", type=int, default=2, help="--engine deepspeed")
    ap.add_argument("--checkpointing", action="store_true", help="trainer.gradient_checkpointing (both paths)")
    ap.add_argument("--optimizer-step", action="store_true", help="also the AdamW step (a whole PPO step)")
    ap.add_argument("--mem-limit-gib", type=float, default=18.0, help="address-space limit of each child (0: none)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--model", type=Path, help="an existing model folder (default: build one)")
    ap.add_argument("--keep-model", type=Path, help="build the model here, or reuse it if it is there")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "train_memory.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return

    with tempfile.TemporaryDirectory() as tmp:
        if args.keep_model and not args.keep_model.exists():
            build_model(args.keep_model, args)
        model = args.model or args.keep_model or build_model(Path(tmp) / "qwen2-shaped", args)
        common = {
            "model": str(model),
            "device": args.device,
            "bf16": args.bf16,
            "checkpointing": args.checkpointing,
            "mem_limit_gib": args.mem_limit_gib,
            "threads": args.threads,
            "engine": args.engine,
            "step": args.optimizer_step,
            "zero_stage": args.zero_stage,
        }
        plan = []
        for budget in args.budgets:
            for path, chunk in (("padded", 0), ("packed", args.chunk)):
                plan.append({"kind": "mixed", "budget": budget, "path": path, "chunk": chunk or args.chunk})
        if args.budgets and args.big_chunk:
            plan.append({"kind": "mixed", "budget": max(args.budgets), "path": "packed", "chunk": args.big_chunk})
        for path in ("padded", "packed") if args.equal_budget else ():
            plan.append({"kind": "equal", "budget": args.equal_budget, "path": path, "chunk": args.chunk})
        rows = []
        print(f"{'case':<28}{'tokens':>8}{'padding':>9}{'peak GiB':>10}{'tokens/s':>10}  status", flush=True)
        for i, p in enumerate(plan, 1):
            case = {**common, **p, "lengths": lengths_for(p["kind"], p["budget"])}
            row = run_case(case)
            rows.append(row)
            name = f"{p['kind']} {p['budget']} {p['path']} c{p['chunk'] if p['path'] == 'packed' else '-'}"
            if row["status"] == "ok":
                print(
                    f"{name:<28}{row['tokens']:>8}{row['padding_frac']:>9.1%}{row['peak_gib']:>10.2f}"
                    f"{row['tokens_per_s']:>10.0f}  ok  [{i}/{len(plan)}]",
                    flush=True,
                )
            else:
                print(f"{name:<28}{'':>37}  {row['status']}  [{i}/{len(plan)}]", flush=True)

    def find(kind, budget, path, chunk):
        return next(
            (r for r in rows if (r["kind"], r["budget"], r["path"], r["chunk"]) == (kind, budget, path, chunk)), None
        )

    top = max(args.budgets) if args.budgets else None
    summary: dict = {}
    if top:
        new, old, big = (
            find("mixed", top, "packed", args.chunk),
            find("mixed", top, "padded", args.chunk),
            find("mixed", top, "packed", args.big_chunk),
        )
        if new and new["status"] == "ok":
            summary["budget"] = top
            summary["packed_peak_gib"] = new["peak_gib"]
            summary["packed_padding_frac"] = new["padding_frac"]
            summary["padded_status"] = old["status"] if old else None
            if old and old["status"] == "ok":
                summary["peak_ratio_packed_to_padded"] = new["peak_gib"] / old["peak_gib"]
            if big and big["status"] == "ok" and args.big_chunk != args.chunk:
                per_position = (big["peak_gib"] - new["peak_gib"]) / (args.big_chunk - args.chunk)
                summary["logits_gib_per_chunk_position"] = per_position
                summary["logits_gib"] = per_position * args.chunk
                summary["logits_share_of_peak"] = per_position * args.chunk / new["peak_gib"]
    eq_new, eq_old = (find("equal", args.equal_budget, p, args.chunk) for p in ("packed", "padded"))
    if eq_new and eq_old and eq_new["status"] == eq_old["status"] == "ok":
        summary["equal_lengths_tokens_per_s_ratio"] = eq_new["tokens_per_s"] / eq_old["tokens_per_s"]
    print(json.dumps(summary, indent=1))
    result = {
        "benchmark": "train_memory",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "child"},
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "rows": rows,
        "summary": summary,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
