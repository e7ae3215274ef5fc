"""Prompt tokens each generation engine prefills for a group of n samples, and the group's generation time:
the torch engine with its group prefill shared (today) and per sample (before), and vLLM's prefix cache.

On the demo model (its config's max_position_embeddings raised to 4096 so the 2000-token prompt fits;
rotary positions have no table to outgrow) and the 99M Qwen2-shaped benchmark model (hidden 512, 4 layers,
Qwen's vocabulary: benchmarks/objective_cost.py's). Each group is a fresh random prompt (no earlier
group's cache can serve it), all n samples added at once as a generator adds a granted group, sampled
at temperature 1 to --max-new tokens each. The torch engine's two modes run round-robin on one engine.

    .venv/bin/python benchmarks/prefill_sharing.py        # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from train_memory import build_model  # noqa: E402

from areal_hpc.engines.base import generate  # noqa: E402
from areal_hpc.engines.torch_gen import TorchGenerationEngine  # noqa: E402
from areal_hpc.model import build_tiny_model  # noqa: E402
from areal_hpc.utils import atomic_write_text  # noqa: E402
from tests.request_helpers import group_requests  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def demo_model(out: Path) -> Path:
    path = build_tiny_model(out)  # jobs/demo.yaml's shape: llama, hidden 128, 2 layers
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def qwen_model(out: Path) -> Path:
    return build_model(out, SimpleNamespace(hidden=512, layers=4, heads=8))


class Groups:
    """Fresh random prompts of a length, one per group, from a vocabulary's ordinary ids."""

    def __init__(self, vocab: int, seed: int = 0):
        self.rng, self.vocab, self.next_id = np.random.default_rng(seed), vocab, 0

    def __call__(self, prompt_len: int, n: int, max_new: int):
        prompt = self.rng.integers(10, self.vocab, size=prompt_len).tolist()
        self.next_id += 1
        return group_requests(prompt, self.next_id, n, max_new)


def one_group(eng, reqs) -> dict:
    p0, s0 = eng.prefill_tokens, eng.prefill_shared_tokens
    t = time.perf_counter()
    generate(eng, reqs)
    return {
        "s": time.perf_counter() - t,
        "prefilled": eng.prefill_tokens - p0,
        "served": eng.prefill_shared_tokens - s0,
    }


def summarize(runs: list[dict], prompt_len: int, n: int) -> dict:
    out = {
        "prompt_tokens": prompt_len,
        "n": n,
        "prefilled_per_group": statistics.median(r["prefilled"] for r in runs),
        "served_per_group": statistics.median(r["served"] for r in runs),
        "s_per_group": statistics.median(r["s"] for r in runs),
        "s_per_group_all": [round(r["s"], 4) for r in runs],
    }
    out["hit_rate"] = out["served_per_group"] / (n * prompt_len)
    return out


def bench_torch(model: Path, groups: Groups, args) -> dict:
    eng = TorchGenerationEngine(str(model), seed=0)
    eng.ignore_eos = True
    for share in (False, True):  # warm-up, both paths
        eng.share_prefill = share
        generate(eng, groups(16, args.n, 4))
    res = {}
    for plen in args.prompt_lens:
        runs = {True: [], False: []}
        for _ in range(args.repeats):  # the two modes round-robin, each on a fresh prompt
            for share in (False, True):
                eng.share_prefill = share
                runs[share].append(one_group(eng, groups(plen, args.n, args.max_new)))
        res[plen] = {"shared": summarize(runs[True], plen, args.n), "per_sample": summarize(runs[False], plen, args.n)}
        # within each round: the machine's load moves both modes' times alike
        res[plen]["speedup"] = statistics.median(a["s"] / b["s"] for a, b in zip(runs[False], runs[True]))
    return res


def bench_vllm(model: Path, groups: Groups, args) -> dict:
    from areal_hpc.engines.vllm_gen import VLLMGenerationEngine

    eng = VLLMGenerationEngine(str(model), seed=0, kv_cache_gib=args.kv_cache_gib)
    eng.ignore_eos = True
    try:
        generate(eng, groups(16, args.n, 4))
        res = {}
        for plen in args.prompt_lens:
            runs = [one_group(eng, groups(plen, args.n, args.max_new)) for _ in range(args.repeats)]
            res[plen] = {"vllm": summarize(runs, plen, args.n)}
    finally:
        eng.close()
    return res


def report(name: str, res: dict) -> None:
    for plen, cases in res.items():
        for case, r in cases.items():
            if case == "speedup":
                continue
            print(
                f"[bench] {name:6s} {plen:5d}-token prompt, n={r['n']}: {case:10s}"
                f" prefilled {r['prefilled_per_group']:7.0f} tokens/group (served {r['served_per_group']:6.0f},"
                f" hit rate {r['hit_rate']:.3f}),"
                f" {r['s_per_group']:.3f} s/group"
            )
        if "speedup" in cases:
            ratio = cases["speedup"]
            print(f"[bench] {name:6s} {plen:5d}-token prompt: torch shared vs per-sample {ratio:.2f}x (per round)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[200, 2000])
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="demo,qwen99m")
    ap.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=RESULTS / "prefill_sharing.json")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # vLLM would otherwise set its own for the process
    torch.set_num_threads(args.threads)
    result = {"host": platform.node(), "threads": args.threads, "n": args.n, "max_new_tokens": args.max_new}
    result["repeats"] = args.repeats
    with tempfile.TemporaryDirectory(prefix="areal-prefill-") as tmp:
        for name in args.models.split(","):
            model = demo_model(Path(tmp) / name) if name == "demo" else qwen_model(Path(tmp) / name)
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            res = bench_torch(model, Groups(vocab), args)
            if args.vllm:
                for plen, r in bench_vllm(model, Groups(vocab, seed=1), args).items():
                    res[plen] |= r
            report(name, res)
            result[name] = {str(k): v for k, v in res.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
