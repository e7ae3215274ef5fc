"""What LoRA changes in the loop, full weights against rank 1, 8 and 32 adapters, side by side:

- bytes per version: measured on the demo model (the bucket plan trainer 0 sends, as metrics.csv's sync_bytes),
  and computed for the 1.5B and 7B shapes (Qwen2.5-1.5B and -7B configs on the meta device, arithmetic printed);
- sync time per version: trainer 0 and two generators under mpirun (gloo), the runtime's WeightSender and
  WeightReceiver, plus the generator's merge of the adapter into its base weights;
- decode tokens/s with an adapter merged against full weights, on the torch and vLLM engines, round-robin;
- trainer time per PPO version and peak memory, LoRA against full;
- with --runs full=RUN_DIR lora=RUN_DIR: the two runs' held-out accuracy at equal wall time.

The benchmark model is Qwen2-shaped (hidden 512, 4 layers) with Qwen's vocabulary, random weights, built
locally (benchmarks/train_memory.py): its output layer, which LoRA leaves alone, is most of its parameters.

    .venv/bin/python benchmarks/lora_cost.py                # CPU, about 6 minutes
    .venv/bin/python benchmarks/lora_cost.py --runs full=runs/demo_full lora=runs/demo_lora
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a bare checkout too

from objective_cost import batch  # noqa: E402  (benchmarks/ is on the path)
from train_memory import build_model  # noqa: E402

from areal_hpc.engines.lora import LoraSpec, adapter_shapes, model_skeleton, target_modules  # noqa: E402
from areal_hpc.utils import atomic_write_text  # noqa: E402

RANKS = [1, 8, 32]
# Qwen2.5's published configs: hidden, intermediate, layers, attention heads, KV heads, vocabulary
SHAPES = {"1.5B": (1536, 8960, 28, 12, 2, 151936), "7B": (3584, 18944, 28, 28, 4, 152064)}


def computed_sizes() -> dict:
    """Adapter and full bytes per version in bf16 for the recipe shapes, from their layer shapes."""
    from transformers import Qwen2Config

    out = {}
    for name, (h, inter, layers, heads, kv, vocab) in SHAPES.items():
        cfg = Qwen2Config(
            hidden_size=h,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=vocab,
            tie_word_embeddings=name == "1.5B",
        )
        with tempfile.TemporaryDirectory() as tmp:
            cfg.save_pretrained(tmp)
            skel = model_skeleton(tmp)
        params = sum(p.numel() for p in skel.parameters())  # tied ones once
        layer0 = [n for n in target_modules(skel) if ".layers.0." in n]
        per_layer = {
            n.rsplit(".", 1)[-1]: (m.in_features, m.out_features) for n in layer0 for m in [skel.get_submodule(n)]
        }
        per_rank = layers * sum(i + o for i, o in per_layer.values())
        out[name] = {
            "params": params,
            "full_bytes_bf16": 2 * params,
            "per_layer_in_plus_out": per_layer,
            "adapter_params_per_rank": per_rank,
            "adapter_bytes_bf16": {r: 2 * r * per_rank for r in RANKS},
        }
    return out


def plan_bytes(model_dir: str, dtype: torch.dtype) -> dict:
    """What trainer 0's bucket plan sends per version (sync_bytes), full and with each rank."""
    from areal_hpc.model import load_causal_lm
    from areal_hpc.runtime.comm.weight_sync import BucketPlan

    full = BucketPlan(load_causal_lm(model_dir, "float32").state_dict(), 1 << 30, dtype=dtype).nbytes
    out = {"full": full}
    for r in RANKS:
        adapter = {k: torch.zeros(s) for k, s in adapter_shapes(model_dir, LoraSpec(r, 32.0)).items()}
        out[f"r{r}"] = BucketPlan(adapter, 1 << 30, dtype=dtype).nbytes
    return out


# -- sync time: trainer 0 + 2 generators under mpirun ---------------------------------------------------------
def sync_child(model_dir: str, repeats: int) -> None:
    from mpi4py import MPI

    from areal_hpc.engines.lora import AdapterMerger
    from areal_hpc.model import load_causal_lm
    from areal_hpc.runtime.comm.weight_sync import SyncGroup, WeightReceiver, WeightSender

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    group = SyncGroup(comm, "gloo", 120)
    base = load_causal_lm(model_dir, "float32").state_dict()
    cases = {"full": base}
    for r in RANKS:
        g = torch.Generator().manual_seed(r)
        cases[f"r{r}"] = {
            k: torch.randn(s, generator=g) for k, s in adapter_shapes(model_dir, LoraSpec(r, 32.0)).items()
        }
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sd in cases.items():
            if comm.rank == 0:
                sender = WeightSender("broadcast", group, Path(tmp), 64, False, 1)
                times = []
                for v in range(repeats + 1):
                    sender.publish(sd, v)
                    times.append(sender.wait()["sync_s"])
                result[name] = {"sync_s": statistics.median(times[1:]), "bytes": sender.plan.nbytes}
            else:
                receiver = WeightReceiver("broadcast", group, Path(tmp), sd, 64)
                layers = sorted({k.rsplit(".lora_", 1)[0] for k in sd}) if name != "full" else []
                merger = AdapterMerger(base, layers, 4.0)
                for _ in range(repeats + 1):  # the transfers alone; a generator merges at its load, later
                    got = receiver.receive(0)
                merge_s = []
                for _ in range(repeats if name != "full" else 0):
                    t0 = time.perf_counter()
                    merger.merged(got)
                    merge_s.append(time.perf_counter() - t0)
                result[name] = {"merge_s": statistics.median(merge_s[1:]) if merge_s else 0.0}
    merged = comm.gather(result, root=0)
    if comm.rank == 0:
        print(json.dumps({"sender": merged[0], "generator": merged[1]}))
    group.close()


def sync_times(model_dir: str, repeats: int) -> dict:
    from areal_hpc.launch.environment import rank_env

    cmd = ["mpirun", "-n", "3", "--oversubscribe", "--bind-to", "none", sys.executable, __file__]
    cmd += ["--sync-child", json.dumps([model_dir, repeats])]
    r = subprocess.run(cmd, env=rank_env(local_mpirun=True), capture_output=True, text=True, timeout=1200)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"sync timing failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


# -- decode speed with a merged adapter ---------------------------------------------------------------------
def decode_speed(kind: str, model_dir: str, rounds: int, n_req: int, new_tokens: int) -> dict:
    """Tokens/s of one engine after a full-weights load and after a merged-adapter load, round-robin."""
    from areal_hpc.engines import make_generation_engine
    from areal_hpc.engines.base import generate
    from areal_hpc.engines.lora import AdapterMerger
    from areal_hpc.types import GenRequest

    eng = make_generation_engine(kind, model_path=model_dir, temperature=1.0, top_p=1.0, dtype="float32", seed=0)
    from areal_hpc.model import load_causal_lm

    base = load_causal_lm(model_dir, "float32").state_dict()  # the folder's: the vLLM engine keeps no copy
    g = torch.Generator().manual_seed(0)
    full = {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in base.items()}
    shapes = adapter_shapes(model_dir, LoraSpec(32, 32.0))
    adapter = {k: 0.02 * torch.randn(s, generator=g) for k, s in shapes.items()}
    merger = AdapterMerger(base, sorted({k.rsplit(".lora_", 1)[0] for k in adapter}), 1.0)
    reqs = lambda: [GenRequest(f"{i}:0", [1 + i, 2 + i, 3 + i], new_tokens) for i in range(n_req)]  # noqa: E731
    speeds: dict[str, list[float]] = {"full": [], "lora": []}
    load_s: dict[str, list[float]] = {"full": [], "lora": []}
    generate(eng, reqs())  # warm-up
    for k in range(rounds):
        for name in ("full", "lora") if k % 2 == 0 else ("lora", "full"):  # neither always goes first
            t0 = time.perf_counter()
            eng.update_weights(full if name == "full" else merger.merged(adapter), eng.version + 1)
            load_s[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            outs = generate(eng, reqs())
            speeds[name].append(sum(len(o.output_ids) for o in outs) / (time.perf_counter() - t0))
    eng.close()
    ratio = [lo / fu for lo, fu in zip(speeds["lora"], speeds["full"], strict=True)]
    return {
        "tokens_per_s": {k: statistics.fmean(v) for k, v in speeds.items()},
        "lora_vs_full": statistics.fmean(ratio),
        "spread": [min(ratio), max(ratio)],
        "load_s": {k: statistics.median(v) for k, v in load_s.items()},
    }


# -- trainer step time and memory ------------------------------------------------------------------------
def trainer_child(case: dict) -> dict:
    from areal_hpc.engines.torch_train import TorchTrainEngine

    torch.set_num_threads(case["threads"])

    def engine(rank):
        lora = LoraSpec(rank, 32.0) if rank else None
        return TorchTrainEngine(case["model"], lr=1e-6, n_minibatches=2, max_tokens_per_mb=4096, lora=lora)

    if case["timing"]:
        engines = {name: engine(r) for name, r in case["ranks"].items()}
        trajs, adv = batch(151936, case["tokens"])
        for e in engines.values():
            e.ppo_update(*batch(151936, 512, seed=1))
        secs: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(case["rounds"]):
            for name, e in engines.items():
                t0 = time.perf_counter()
                e.ppo_update(trajs, adv)
                secs[name].append(time.perf_counter() - t0)
        return {"seconds": secs}
    # a spawned child's ru_maxrss starts at its parent's peak (Linux keeps the high-water mark across exec):
    # reset it, then read this process's own
    Path("/proc/self/clear_refs").write_text("5")
    e = engine(case["rank"])
    e.ppo_update(*batch(151936, 512, seed=1))
    e.ppo_update(*batch(151936, case["tokens"]))
    trained = sum(p.numel() for p in e.model.parameters() if p.requires_grad)
    hwm = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM"))
    return {"peak_gib": int(hwm.split()[1]) / 2**20, "trained_params": trained}


def run_child(case: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"lora cost failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def curves(runs: dict[str, str]) -> dict:
    """Held-out accuracy of each run at the wall times where all of them evaluated."""
    import pandas as pd

    out = {}
    for name, run in runs.items():
        m = pd.read_csv(Path(run) / "metrics.csv")[["version", "wall_s", "heldout_acc", "sync_s", "sync_bytes"]]
        ev = m.dropna(subset=["heldout_acc"])
        out[name] = {
            "curve": ev[["wall_s", "heldout_acc"]].values.tolist(),
            "sync_s_median": float(m["sync_s"].median()),
            "sync_bytes": float(m["sync_bytes"].median()),
            "versions": int(m["version"].max()),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the trainer's batch")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--runs", nargs="*", default=[], help="NAME=RUN_DIR: compare their learning curves")
    ap.add_argument(
        "--parts", default="sync,decode,memory,trainer", help="which measurements (sizes are always printed)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lora_cost.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--sync-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(trainer_child(json.loads(args.child))))
        return
    if args.sync_child:
        sync_child(*json.loads(args.sync_child))
        return
    if args.runs:
        result = {"benchmark": "lora_curves", "runs": curves(dict(kv.split("=", 1) for kv in args.runs))}
        for name, r in result["runs"].items():
            pts = ", ".join(f"{w:.0f}s {a:.0%}" for w, a in r["curve"])
            print(f"{name}: {r['versions']} versions, sync {r['sync_s_median'] * 1e3:.1f} ms, {pts}")
        atomic_write_text(args.out.with_name("lora_curves.json"), json.dumps(result, indent=1))
        return

    from areal_hpc.config import load_config
    from areal_hpc.model import ensure_model

    sizes = computed_sizes()
    for name, s in sizes.items():
        terms = " + ".join(f"{i}+{o}" for i, o in s["per_layer_in_plus_out"].values())
        print(f"[{name}] adapter params per rank: 28 layers x ({terms}) = {s['adapter_params_per_rank']:,}")
        print(
            f"[{name}] bf16 bytes per version: full {s['full_bytes_bf16'] / 1e9:.2f} GB ({s['params'] / 1e9:.2f}B); "
            + ", ".join(
                f"r{r} {b / 1e6:.1f} MB ({s['full_bytes_bf16'] / b:.0f}x less)"
                for r, b in s["adapter_bytes_bf16"].items()
            )
        )
    demo_dir = str(ensure_model(load_config(ROOT / "jobs" / "demo.yaml").model))
    demo_bytes = plan_bytes(demo_dir, torch.float32)
    print("[demo model] bytes per version (fp32, as sent): " + ", ".join(f"{k} {v:,}" for k, v in demo_bytes.items()))
    result = {
        "benchmark": "lora_cost",
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "computed": sizes,
        "demo_bytes": demo_bytes,
    }
    parts = set(args.parts.split(","))
    if args.out.exists():  # a run of some parts keeps the others' figures
        result = json.loads(args.out.read_text()) | result
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "model", argparse.Namespace(hidden=512, layers=4, heads=8)))
        result["bench_bytes"] = plan_bytes(model, torch.float32)
        for name, m in (("demo", demo_dir), ("bench", model)) if "sync" in parts else ():
            result[f"sync_{name}"] = sync_times(m, repeats=5)
            snd, gen = result[f"sync_{name}"]["sender"], result[f"sync_{name}"]["generator"]
            print(
                f"[sync {name}] per version: "
                + ", ".join(
                    f"{k} {v['sync_s'] * 1e3:.1f} ms ({v['bytes'] / 1e6:.2f} MB, "
                    f"merge {gen[k]['merge_s'] * 1e3:.1f} ms)"
                    for k, v in snd.items()
                ),
                flush=True,
            )
        for kind in ("torch", "vllm") if "decode" in parts else ():
            result[f"decode_{kind}"] = d = decode_speed(kind, model, 2 * args.rounds, n_req=16, new_tokens=64)
            print(
                f"[decode {kind}] tokens/s full {d['tokens_per_s']['full']:.0f}, merged r32 adapter "
                f"{d['tokens_per_s']['lora']:.0f}: {d['lora_vs_full']:.3f} "
                f"({d['spread'][0]:.3f}-{d['spread'][1]:.3f}); "
                f"load {d['load_s']['full'] * 1e3:.0f} ms full, {d['load_s']['lora'] * 1e3:.0f} ms merge + load",
                flush=True,
            )
        ranks = {"full": 0, "r8": 8, "r32": 32}
        base = dict(model=model, threads=args.threads, tokens=args.tokens)
        if "memory" in parts:
            result["memory"] = {name: run_child({**base, "timing": False, "rank": r}) for name, r in ranks.items()}
        if "trainer" in parts:
            timing = run_child({**base, "timing": True, "ranks": ranks, "rounds": args.rounds})["seconds"]
            result["trainer_seconds"] = timing
    if "trainer_seconds" in result and "memory" in result:
        timing, mem = result["trainer_seconds"], result["memory"]
        rows = []
        for name in ranks:
            speed = [f / s for f, s in zip(timing["full"], timing[name], strict=True)]
            rows.append(
                {
                    "case": name,
                    "seconds": statistics.fmean(timing[name]),
                    "speed_vs_full": statistics.fmean(speed),
                    "peak_gib": mem[name]["peak_gib"],
                    "trained_params": mem[name]["trained_params"],
                }
            )
            r = rows[-1]
            print(
                f"[trainer] {name:<5} {r['seconds']:.2f} s/version ({r['speed_vs_full']:.2f}x full's speed), "
                f"peak {r['peak_gib']:.2f} GiB, {r['trained_params'] / 1e6:.2f}M trained"
            )
        result["trainer"] = rows
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
