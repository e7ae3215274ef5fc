"""What the torch generation engine's slot KV cache costs: a step's time against the batch's rows and
width (every row attends over the window the longest-lived row sets), and where the time of a
continuously refilled batch goes (the decode forward, the joiners' prefill, writing them into the cache,
dropping finished rows).

    .venv/bin/python benchmarks/torch_cache.py        # about a minute on 1 core
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from areal_hpc.engines.torch_gen import TorchGenerationEngine  # noqa: E402
from areal_hpc.model import build_tiny_model, load_tokenizer  # noqa: E402
from areal_hpc.types import GenRequest  # noqa: E402
from areal_hpc.utils import atomic_write_text  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PARTS = ("_decode", "_prefill", "_merge", "_drop_rows")  # _merge runs inside _prefill


def width_cost(model: Path, prompt: list[int], rows: int, long_len: int, steps: int = 30) -> dict:
    """ms per decode step of `rows` running rows, one of them `long_len` tokens longer than the rest."""
    eng = TorchGenerationEngine(str(model), seed=0, max_num_seqs=rows)
    eng.ignore_eos = True
    reqs = [GenRequest(f"r{i}:0", prompt, 400) for i in range(rows - 1)]
    eng.add(reqs + [GenRequest("long:0", prompt + [prompt[0]] * long_len, 400)])
    for _ in range(4):
        eng.step()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return {"rows": rows, "width": eng._cache.width, "ms_per_step": 1e3 * (time.perf_counter() - t) / steps}


def refilled_batch(model: Path, prompt: list[int], rows: int, steps: int = 400) -> dict:
    """A batch kept at `rows` requests (answers end at EOS, up to 128 tokens): ms per step and its parts."""
    eng = TorchGenerationEngine(str(model), seed=0, max_num_seqs=256)
    ids = itertools.count()

    def top_up() -> None:
        if (n := rows - eng.num_running - eng.num_waiting) > 0:
            eng.add([GenRequest(f"{next(ids)}:0", prompt, 128) for _ in range(n)])

    for _ in range(200):  # the batch's ages and widths settle
        top_up()
        eng.step()
    prof, running = cProfile.Profile(), 0
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        top_up()
        running += eng.num_running
        eng.step()
    prof.disable()
    out = {"rows": running / steps, "ms_per_step": 1e3 * (time.perf_counter() - t) / steps}
    cum = {k[2]: v[3] for k, v in pstats.Stats(prof).stats.items() if k[2] in PARTS}
    out.update({f"{p.strip('_')}_ms": 1e3 * cum.get(p, 0.0) / steps for p in PARTS})
    return out


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "torch_cache.json")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a generator rank runs
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        prompt = load_tokenizer(model).encode("07+35=")
        widths = [width_cost(model, prompt, r, n) for r in (32, 48, 80) for n in (0, 130)]
        refills = [refilled_batch(model, prompt, r) for r in (48, 96)]
    for w in widths:
        print(f"rows {w['rows']:3d} width {w['width']:4d}: {w['ms_per_step']:6.2f} ms per step")
    for r in refills:
        parts = ", ".join(f"{p.strip('_')} {r[p.strip('_') + '_ms']:.2f}" for p in PARTS)
        print(f"refilled batch of {r['rows']:.0f} rows: {r['ms_per_step']:.2f} ms per step ({parts} ms)")
    result = {"benchmark": "torch_cache", "host": platform.node(), "time": time.time(), "width": widths}
    result["refilled"] = refills
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
