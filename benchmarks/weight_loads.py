"""Generation tokens/s across weight loads under each rollout.weight_update mode, on one engine with no trainer:
keep_kv (load between two steps, running requests go on), recompute (interrupt, load, prefill prompt +
partial again) and drain (stop admitting, let the running finish, then load).

A stream of requests keeps --in-flight sequences in the engine; each request's answer length is drawn
from a long-tailed (geometric) law capped at --max-new and sampled to exactly that length (EOS ignored),
the same draws for every mode. New weights arrive every --period-s seconds, as a trainer would publish
them; the figure is the tokens of finished answers per second over --loads periods (an answer resumed by
`recompute` counts once, its second prefill adds nothing). Modes alternate over --repeats.

    .venv/bin/python benchmarks/weight_loads.py                               # CPU, tiny model, ~1 minute
    python3 benchmarks/weight_loads.py --device cuda --dtype bfloat16 --engine vllm --hidden 1024 \\
        --layers 24 --heads 16 --max-new 4096 --in-flight 256 --period-s 8 --loads 5   # the GPU check
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a bare checkout too (the GPU machine has no install of this package)

from engines import make_gen  # noqa: E402  (benchmarks/ is on the path when a benchmark runs as a script)

from areal_hpc.model import build_tiny_model, load_causal_lm, load_tokenizer  # noqa: E402
from areal_hpc.types import GenRequest  # noqa: E402
from areal_hpc.utils import atomic_write_text  # noqa: E402

MODES = ("keep_kv", "recompute", "drain")


def answer_lengths(n: int, mean: float, cap: int, seed: int = 0) -> list[int]:
    """n geometric lengths with this mean, capped: most answers short, a few at the cap, as in reasoning."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.geometric(1.0 / mean, size=n), cap).astype(int).tolist()


def run_mode(engine, mode: str, prompts: list[list[int]], lengths: list[int], args) -> dict:
    """Keep the engine full for --loads periods, loading the model folder's weights at every period's end (the vLLM
    engine keeps no copy of its own to take them from)."""
    weights = load_causal_lm(engine.model_path, args.dtype).state_dict()
    next_req, running = 0, 0
    finished_tokens, finished, resumed = 0, 0, 0
    prefill0 = engine.prefill_tokens
    requests: dict[str, GenRequest] = {}
    t0 = time.perf_counter()
    due, loads, version, pending = t0 + args.period_s, 0, engine.version, False
    load_s = 0.0
    while loads < args.loads:
        if not (mode == "drain" and pending):  # drain admits nothing while a load waits
            new = []
            while running + len(new) < args.in_flight:
                i = next_req % len(lengths)
                r = GenRequest(f"{mode}-{next_req}", prompts[i % len(prompts)], lengths[i])
                requests[r.request_id] = r
                new.append(r)
                next_req += 1
            engine.add(new)
            running += len(new)
        for out in engine.step():
            del requests[out.request_id]
            running -= 1
            finished += 1
            finished_tokens += len(out.output_ids)
        if time.perf_counter() >= due:
            pending = True
        if pending and (mode != "drain" or running == 0):
            t = time.perf_counter()
            partials = engine.interrupt() if mode == "recompute" else []
            engine.pause()
            version += 1
            engine.update_weights(weights, version, keep_kv=mode == "keep_kv")
            engine.resume()
            engine.add([requests[o.request_id].resumed(o) for o in partials])
            resumed += len(partials)
            load_s += time.perf_counter() - t
            loads, pending, due = loads + 1, False, due + args.period_s
    wall = time.perf_counter() - t0
    engine.interrupt()
    return {
        "tokens_per_s": finished_tokens / wall,
        "finished": finished,
        "wall_s": wall,
        "prefill_tokens_per_period": (engine.prefill_tokens - prefill0) / loads,  # new prompts and re-prefills
        "resumed_per_load": resumed / loads,
        "load_ms": 1e3 * load_s / loads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=128, help="the cap on an answer's length")
    ap.add_argument("--mean-new", type=float, default=0.0, help="mean answer length (default: a sixth of the cap)")
    ap.add_argument("--in-flight", type=int, default=64, help="sequences kept in the engine")
    ap.add_argument("--period-s", type=float, default=1.0, help="seconds between two weight loads")
    ap.add_argument("--loads", type=int, default=6, help="weight loads per mode and repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "weight_loads.json")
    args = ap.parse_args()
    args.max_num_seqs = max(args.in_flight, 1)
    if args.device == "cpu":
        torch.set_num_threads(1)
    model = build_tiny_model(
        args.out.parent / f"weight_loads_model_{args.hidden}x{args.layers}",
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        if_absent=True,
    )
    tok = load_tokenizer(model)
    prompts = [tok.encode(f"{a:02d}+{b:02d}=") for a, b in zip(range(50), range(50, 0, -1))]
    lengths = answer_lengths(20_000, args.mean_new or args.max_new / 6, args.max_new)
    engine = make_gen(args.engine, model, args)  # EOS ignored: every answer has its drawn length
    run_mode(engine, "keep_kv", prompts, lengths, argparse.Namespace(**{**vars(args), "loads": 1}))  # warm-up
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        for mode in MODES:
            runs[mode].append(run_mode(engine, mode, prompts, lengths, args))
            r = runs[mode][-1]
            print(
                f"[bench] {mode:<9} run {rep + 1}: {r['tokens_per_s']:9.0f} tokens/s,"
                f" {r['prefill_tokens_per_period']:8.0f} prefill tokens per period,"
                f" {r['resumed_per_load']:5.0f} resumed per load, load {r['load_ms']:.0f} ms",
                flush=True,
            )
    engine.close()
    table = {m: float(np.mean([r["tokens_per_s"] for r in rs])) for m, rs in runs.items()}
    for m in MODES:
        print(f"{m:<9} {table[m]:9.0f} tokens/s  {table[m] / table['keep_kv']:.2f}x keep_kv")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "weight_loads",
        "host": platform.node(),
        "time": time.time(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "runs": runs,
        "tokens_per_s": table,
    }
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
