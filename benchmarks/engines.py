"""Engines side by side on the same prompts and the same batch: generation tokens/s (vLLM vs the torch
engine) and trainer tokens/s (DeepSpeed ZeRO vs the torch engine), on CPU here or on a GPU.

Every sequence is sampled to exactly --max-new tokens (EOS ignored), so both generation engines produce
the same number of tokens; the trainers take the same PPO step on the same trajectories. Each engine is
timed --repeats times, engines alternating, after a warm-up; the best time counts (the machine is shared).

    .venv/bin/python benchmarks/engines.py                       # CPU, tiny model, about 2 minutes
    python3 benchmarks/engines.py --device cuda --hidden 1024 --layers 24 --gen torch --train deepspeed,torch
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a bare checkout too (the GPU machine has no install of this package)

from areal_hpc.engines.base import generate  # noqa: E402
from areal_hpc.model import build_tiny_model, load_tokenizer  # noqa: E402
from areal_hpc.types import GenRequest  # noqa: E402
from tests.request_helpers import sample_request  # noqa: E402


def make_gen(kind: str, model: Path, args):
    if kind == "torch":
        from areal_hpc.engines.torch_gen import TorchGenerationEngine

        eng = TorchGenerationEngine(
            str(model), dtype=args.dtype, seed=0, device=args.device, max_num_seqs=args.max_num_seqs
        )
    else:
        from areal_hpc.engines.vllm_gen import VLLMGenerationEngine

        eng = VLLMGenerationEngine(
            str(model),
            dtype=args.dtype,
            seed=0,
            device=args.device,
            kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=args.max_num_seqs,
        )
    eng.ignore_eos = True
    return eng


def make_train(kind: str, model: Path, args):
    common = dict(
        lr=1e-6, n_minibatches=args.minibatches, max_tokens_per_mb=args.tokens_per_mb, seed=0, device=args.device
    )
    if kind == "torch":
        from areal_hpc.engines.torch_train import TorchTrainEngine

        return TorchTrainEngine(str(model), bf16=args.dtype == "bfloat16", **common)
    from areal_hpc.engines.deepspeed_train import DeepSpeedTrainEngine

    return DeepSpeedTrainEngine(str(model), zero_stage=args.zero_stage, bf16=args.dtype == "bfloat16", **common)


def best_of(fns: dict, repeats: int) -> dict[str, float]:
    """Seconds per call, the best of `repeats`, engines alternating so drift in load hits all of them."""
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def write_json(path: Path, result: dict) -> None:
    """Atomic; called after each phase, so a failure in training keeps the generation figures."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=32, help="prompts, each sampled --samples times")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--gen", default="torch,vllm", help="generation engines to compare")
    ap.add_argument("--train", default="torch,deepspeed", help="training engines to compare")
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--tokens-per-mb", type=int, default=4096)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="engine slots (both engines)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads for every engine")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engines.json")
    args = ap.parse_args()
    # the same thread count for every engine: vLLM would otherwise lower it for the whole process
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    gens = [g for g in args.gen.split(",") if g]
    trains = [t for t in args.train.split(",") if t]

    work = Path(tempfile.mkdtemp(prefix="areal-bench-"))
    model = build_tiny_model(
        work / "model",
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        seed=0,
    )
    n_params = sum(
        v.numel()
        for v in __import__("safetensors.torch", fromlist=["load_file"])
        .load_file(str(model / "model.safetensors"))
        .values()
    )
    print(
        f"[bench] model: hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.1f}M parameters, "
        f"{args.dtype} on {args.device}"
    )
    tok = load_tokenizer(model)
    prompts = [f"{a:02d}+{b:02d}=" for a, b in zip(range(args.prompts), range(args.prompts, 0, -1))]
    reqs = [
        GenRequest(sample_request(i, s), tok.encode(p), args.max_new)
        for i, p in enumerate(prompts)
        for s in range(args.samples)
    ]
    result = {
        "device": args.device,
        "dtype": args.dtype,
        "params_m": n_params / 1e6,
        "host": platform.node(),
        "threads": args.threads,
        "requests": len(reqs),
        "max_new_tokens": args.max_new,
    }

    outs = None
    if gens:
        engines = {k: make_gen(k, model, args) for k in gens}
        for e in engines.values():
            outs = generate(e, reqs[:4])  # warm-up
        gen_tokens = len(reqs) * args.max_new
        last = {}
        secs = best_of(
            {k: (lambda k=k: last.__setitem__(k, generate(engines[k], reqs))) for k in engines}, args.repeats
        )
        outs = last[gens[0]]
        assert all(len(o.output_ids) == args.max_new for o in outs)
        result["generation_tokens_per_s"] = {k: gen_tokens / s for k, s in secs.items()}
        for k in engines:
            print(
                f"[bench] generation {k:>9}: {gen_tokens / secs[k]:9.0f} tokens/s "
                f"({gen_tokens} tokens in {secs[k]:.2f} s)"
            )
        # long-tailed lengths, as in reasoning: the untrained model stops at EOS at random; with continuous
        # batching a finished row costs nothing more
        for e in engines.values():
            e.ignore_eos = False
        tail: dict = {}
        tail_secs = best_of(
            {k: (lambda k=k: tail.__setitem__(k, generate(engines[k], reqs))) for k in engines}, args.repeats
        )
        tail_tokens = {k: sum(len(o.output_ids) for o in v) for k, v in tail.items()}
        result["generation_tail_tokens_per_s"] = {k: tail_tokens[k] / s for k, s in tail_secs.items()}
        for k, e in engines.items():
            lens = [len(o.output_ids) for o in tail[k]]
            print(
                f"[bench] generation {k:>9}, EOS on: {tail_tokens[k] / tail_secs[k]:9.0f} tokens/s (lengths mean "
                f"{np.mean(lens):.0f}, max {max(lens)})"
            )
            e.close()
        if {"vllm", "torch"} <= set(secs):
            result["generation_vllm_over_torch"] = secs["torch"] / secs["vllm"]
            result["generation_tail_vllm_over_torch"] = (
                result["generation_tail_tokens_per_s"]["vllm"] / result["generation_tail_tokens_per_s"]["torch"]
            )
            print(
                f"[bench] generation vllm / torch: {result['generation_vllm_over_torch']:.2f}x equal lengths, "
                f"{result['generation_tail_vllm_over_torch']:.2f}x long-tailed"
            )

        write_json(args.out, result)

    if trains:
        if outs is None:  # no generation engine asked for: random tokens of the same shape
            rng = np.random.default_rng(0)
            from areal_hpc.types import GenOutput

            outs = [
                GenOutput(
                    r.request_id,
                    r.prompt_ids,
                    rng.integers(4, len(tok), args.max_new).tolist(),
                    [-1.0] * args.max_new,
                    [0] * args.max_new,
                    "length",
                )
                for r in reqs
            ]
        from tests.request_helpers import output_trajectory

        trajs = [output_trajectory(o, o.request_id.episode.group_id, 0.0) for o in outs]
        adv = np.where(np.arange(len(trajs)) % 2 == 0, 1.0, -1.0).astype(np.float32)
        train_tokens = sum(len(t.input_ids) for t in trajs)
        engines = {k: make_train(k, model, args) for k in trains}
        for e in engines.values():
            e.ppo_update(trajs[:8], adv[:8])  # warm-up (DeepSpeed builds its buckets on the first step)
        secs = best_of({k: (lambda k=k: engines[k].ppo_update(trajs, adv)) for k in engines}, args.repeats)
        result["train_tokens_per_s"] = {k: train_tokens / s for k, s in secs.items()}
        for k in engines:
            print(
                f"[bench] training   {k:>9}: {train_tokens / secs[k]:9.0f} tokens/s ({train_tokens} tokens, "
                f"{args.minibatches} optimizer steps, in {secs[k]:.2f} s)"
            )
        if {"deepspeed", "torch"} <= set(secs):
            result["train_deepspeed_over_torch"] = secs["torch"] / secs["deepspeed"]
            print(
                f"[bench] training deepspeed (ZeRO-{args.zero_stage}) / torch: "
                f"{result['train_deepspeed_over_torch']:.2f}x"
            )

    write_json(args.out, result)
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
