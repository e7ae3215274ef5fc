"""The vLLM generator's weight path before and after issue 50, side by side in one run: seconds per weight update
(the old engine's host mirror + `reload_weights` against the new one's shared-memory file through vLLM's
weight-transfer API), the generator process's resident memory, TP 1 against TP 2 tokens/s, and requests a keep_kv
update interrupts.

The old engine runs from a git worktree of commit ffecf22 (made here if missing), each engine in its own process so
its resident memory is its own; old and new alternate, --repeats rounds, and the table gives medians.

    .venv/bin/python benchmarks/vllm_weight_path.py            # CPU, about 9 minutes on 2 cores
    .venv/bin/python benchmarks/vllm_weight_path.py --quick    # one round, about 4 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Only the standard library at the top: a child imports areal_hpc from the tree it measures (old or new), and the
# TP 2 engine's spawned workers re-import this module
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OLD_COMMIT = "ffecf22"  # the last engine with a host mirror and collective_rpc("reload_weights")
OLD_TREE = Path("/tmp/areal-old")
TINY = dict(hidden_size=128, intermediate_size=512, num_layers=2, num_heads=4)  # the demo's model (jobs/demo.yaml)
RESULT_TAG = "RESULT "


# -- in a child process: one engine ----------------------------------------------------------------------------------
def _memory_mib() -> dict[str, float]:
    """This process's resident memory now, its parts and its peak (/proc/self/status), in MiB. File pages (a
    safetensors file mapped while loading) are page cache the kernel may drop; anonymous pages are what it holds."""
    names = {"VmRSS": "rss_mib", "RssAnon": "anon_mib", "RssFile": "file_mib", "RssShmem": "shmem_mib"}
    fields = {"peak_mib": 0.0}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in names or key == "VmHWM":
            fields[names.get(key, "peak_mib")] = int(value.split()[0]) / 1024
    return fields


def _release_freed() -> None:
    """Freed tensors back to the OS, so RSS counts what is held rather than what the allocator kept."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _engine(spec: dict, **kw):
    from areal_hpc.engines.vllm_gen import VLLMGenerationEngine

    return VLLMGenerationEngine(spec["model"], seed=0, kv_cache_gib=spec["kv_cache_gib"], **kw)


def _weights(model: str) -> dict:
    from areal_hpc.model import load_causal_lm

    return load_causal_lm(model).state_dict()  # a trainer's export: the tied head under both names


def child_sync(spec: dict) -> dict:
    """Start one engine (old or new code), time `updates` loads of the model's own weights, and read RSS."""
    t0 = time.perf_counter()
    eng = _engine(spec, max_num_seqs=64)
    out = {"startup_s": time.perf_counter() - t0, "after_startup": _memory_mib()}
    weights = _weights(spec["model"])
    unique = {t.data_ptr(): t.nbytes for t in weights.values()}  # a tied tensor once
    out["model_bytes"], out["update_s"], out["receive_s"] = sum(unique.values()), [], []
    for version in range(1, spec["updates"] + 1):
        t = time.perf_counter()
        eng.update_weights(weights, version)
        out["update_s"].append(time.perf_counter() - t)
        out["receive_s"].append(getattr(eng, "receive_s", None))  # the new engine's workers: receive + load
    del weights  # the caller's copy is the trainer's, not the generator's
    _release_freed()
    out["after_updates"] = _memory_mib()
    out["mirror"] = hasattr(eng, "mirror")
    eng.close()
    return out


def _children_rss_mib() -> float:
    import psutil

    return sum(c.memory_info().rss for c in psutil.Process().children(recursive=True)) / (1 << 20)


def child_generate(spec: dict) -> dict:
    """The new engine at `tp`: tokens/s of n requests x max_new tokens (EOS ignored), then the keep_kv check."""
    from areal_hpc.engines.base import generate
    from areal_hpc.model import load_tokenizer
    from areal_hpc.types import GenRequest

    t0 = time.perf_counter()
    eng = _engine(spec, tensor_parallel=spec["tp"], max_num_seqs=max(64, spec["requests"]))
    out = {"startup_s": time.perf_counter() - t0, "memory": _memory_mib(), "workers_rss_mib": _children_rss_mib()}
    eng.ignore_eos = True
    tok = load_tokenizer(spec["model"])
    prompts = [tok.encode(f"{a:02d}+{b:02d}=") for a, b in zip(range(50), range(50, 0, -1))]
    n, new = spec["requests"], spec["max_new"]
    generate(eng, [GenRequest(f"warm{i}", prompts[i], 16) for i in range(8)])
    out["tokens_per_s"] = []
    for rep in range(spec["gen_repeats"]):
        reqs = [GenRequest(f"g{rep}-{i}", prompts[i % len(prompts)], new) for i in range(n)]
        t = time.perf_counter()
        outs = generate(eng, reqs)
        dt = time.perf_counter() - t
        if any(len(o.output_ids) != new for o in outs):
            raise RuntimeError(f"tp {spec['tp']}: an answer ended before {new} tokens with EOS ignored")
        out["tokens_per_s"].append(n * new / dt)
    out["keep_kv"] = keep_kv_check(eng, spec, prompts)
    eng.close()
    return out


def keep_kv_check(eng, spec: dict, prompts: list[list[int]]) -> dict:
    """Requests in flight while two updates land between steps (keep_kv): none may end aborted, and each answer's
    versions must step 0 -> 1 -> 2 at the steps the loads happened (vLLM's own per-token stamps)."""
    from areal_hpc.types import GenRequest

    weights = _weights(spec["model"])
    n, new, loads = 16, 40, {5: 1, 15: 2}  # step -> version loaded before it
    checked0, mismatched0 = eng.versions_checked, eng.versions_mismatched
    eng.add([GenRequest(f"k{i}", prompts[i], new) for i in range(n)])
    outs, steps = [], 0
    while len(outs) < n and steps < 10 * new:
        if steps in loads:
            eng.update_weights(weights, loads[steps], keep_kv=True)
        outs += eng.step()
        steps += 1
    want = [0] * 5 + [1] * 10 + [2] * (new - 15)
    return {
        "requests": n,
        "finished": len(outs),
        "aborted": sum(o.finish_reason == "abort" for o in outs),
        "switched_mid_answer": sum(o.output_versions == want for o in outs),
        "versions_checked": eng.versions_checked - checked0,
        "versions_mismatched": eng.versions_mismatched - mismatched0,
    }


def child_main(spec: dict) -> None:
    sys.path.insert(0, spec["code"])  # this tree's areal_hpc, before the installed (editable) one
    import areal_hpc

    if not Path(areal_hpc.__file__).is_relative_to(spec["code"]):
        raise RuntimeError(f"imported areal_hpc from {areal_hpc.__file__}, not from {spec['code']}")
    result = child_sync(spec) if spec["task"] == "sync" else child_generate(spec)
    print(RESULT_TAG + json.dumps(result), flush=True)


# -- in the parent: models, rounds, the table ------------------------------------------------------------------------
def old_tree() -> Path:
    """A git worktree of the old engine's commit (made once; reused while it is at that commit)."""
    if not (OLD_TREE / "areal_hpc").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=True)
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--quiet", "--detach", str(OLD_TREE), OLD_COMMIT], check=True
        )
    head = subprocess.run(["git", "-C", str(OLD_TREE), "rev-parse", "HEAD"], capture_output=True, text=True)
    if not head.stdout.startswith(OLD_COMMIT):
        raise SystemExit(f"{OLD_TREE} is not a worktree at {OLD_COMMIT}: remove it and run again")
    return OLD_TREE


def run_child(spec: dict, timeout: float = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": spec["code"]}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the engine sizes its KV cache itself
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if r.returncode != 0 or not lines:
        tail = (r.stdout[-1500:] + r.stderr[-3000:]).strip()
        raise SystemExit(f"child {spec['task']} ({spec['label']}) failed with exit {r.returncode}:\n{tail}")
    return json.loads(lines[-1][len(RESULT_TAG) :])


def build_models(args) -> dict[str, tuple[str, dict]]:
    from areal_hpc.model import build_tiny_model

    big = dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_layers=args.layers, num_heads=args.heads)
    models = {}
    for name, shape in (("tiny", TINY), (f"{args.hidden}x{args.layers}", big)):
        path = RESULTS / f"vllm_weight_path_model_{shape['hidden_size']}x{shape['num_layers']}"
        models[name] = (str(build_tiny_model(path, arch="llama", seed=0, if_absent=True, **shape)), shape)
    return models


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def summarise(runs: dict, models: dict) -> dict:
    sync = {}
    for name in models:
        row = {}
        for code in ("old", "new"):
            rs = runs["sync"][name][code]
            row[code] = {
                "update_s": median([s for r in rs for s in r["update_s"]]),
                "rss_startup_mib": median([r["after_startup"]["rss_mib"] for r in rs]),
                "rss_updates_mib": median([r["after_updates"]["rss_mib"] for r in rs]),
                "anon_updates_mib": median([r["after_updates"]["anon_mib"] for r in rs]),
                "peak_mib": median([r["after_updates"]["peak_mib"] for r in rs]),
                "startup_s": median([r["startup_s"] for r in rs]),
            }
        rs = runs["sync"][name]["new"]
        row["new"]["receive_s"] = median([s for r in rs for s in r["receive_s"]])
        row["model_mib"] = rs[0]["model_bytes"] / (1 << 20)
        row["params_m"] = rs[0]["model_bytes"] / 4 / 1e6  # float32
        row["old_over_new_s"] = row["old"]["update_s"] / row["new"]["update_s"]
        row["rss_saved_mib"] = row["old"]["rss_updates_mib"] - row["new"]["rss_updates_mib"]
        sync[name] = row
    gen = {}
    for tp, rs in runs["generate"].items():
        gen[tp] = {
            "tokens_per_s": median([x for r in rs for x in r["tokens_per_s"]]),
            "generator_rss_mib": median([r["memory"]["rss_mib"] for r in rs]),
            "workers_rss_mib": median([r["workers_rss_mib"] for r in rs]),
            "startup_s": median([r["startup_s"] for r in rs]),
            "keep_kv": rs[-1]["keep_kv"],
        }
    return {"sync": sync, "generate": gen}


def print_table(s: dict, args) -> None:
    print(f"\nweight update per version, median over {args.repeats} round(s) x {args.updates} updates (float32):")
    print(f"{'model':<10} {'params':>7} {'MiB':>6} {'old s':>7} {'new s':>7} {'old/new':>8} {'new: workers s':>15}")
    for name, r in s["sync"].items():
        print(
            f"{name:<10} {r['params_m']:6.1f}M {r['model_mib']:6.0f} {r['old']['update_s']:7.3f} "
            f"{r['new']['update_s']:7.3f} {r['old_over_new_s']:7.2f}x {r['new']['receive_s']:15.3f}"
        )
    print(f"\ngenerator process RSS (MiB) after start-up and after {args.updates} updates (TP 1: vLLM's worker in it):")
    head = ("model", "MiB", "old start", "new start", "old end", "new end", "saved")
    print(f"{head[0]:<10} " + " ".join(f"{h:>10}" for h in head[1:]) + "  end: anonymous pages; peaks")
    for name, r in s["sync"].items():
        o, n = r["old"], r["new"]
        print(
            f"{name:<10} {r['model_mib']:10.0f} {o['rss_startup_mib']:10.0f} {n['rss_startup_mib']:10.0f} "
            f"{o['rss_updates_mib']:10.0f} {n['rss_updates_mib']:10.0f} {r['rss_saved_mib']:10.0f}  "
            f"old {o['anon_updates_mib']:.0f}, new {n['anon_updates_mib']:.0f}; old {o['peak_mib']:.0f}, "
            f"new {n['peak_mib']:.0f}"
        )
    for label, params in s["mirror_at_scale"].items():
        print(f"a mirror at {label} in bf16: {params['bytes'] / 1e9:.0f} GB ({params['bytes'] / (1 << 30):.1f} GiB)")
    g = s["generate"]
    print(f"\nnew engine, tiny model, {args.requests} requests x {args.max_new} tokens (EOS ignored):")
    for tp, r in g.items():
        k = r["keep_kv"]
        print(
            f"TP {tp}: {r['tokens_per_s']:7.0f} tokens/s, generator RSS {r['generator_rss_mib']:.0f} MiB + workers "
            f"{r['workers_rss_mib']:.0f} MiB; keep_kv: {k['aborted']} of {k['requests']} aborted, "
            f"{k['switched_mid_answer']} switched 0->1->2 mid-answer, {k['versions_mismatched']} of "
            f"{k['versions_checked']} token versions differ from vLLM's"
        )
    if {"1", "2"} <= set(g):
        print(f"TP 2 / TP 1: {g['2']['tokens_per_s'] / g['1']['tokens_per_s']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768, help="the larger model's width (intermediate 4x)")
    ap.add_argument("--layers", type=int, default=8, help="the larger model's layers (768 x 8: 75M parameters)")
    ap.add_argument("--heads", type=int, default=12, help="the larger model's attention heads")
    ap.add_argument("--repeats", type=int, default=2, help="rounds; old and new (TP 1 and TP 2) alternate")
    ap.add_argument("--updates", type=int, default=3, help="weight updates per engine")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--gen-repeats", type=int, default=2, help="timed generations per TP engine")
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--quick", action="store_true", help="one round, one timed generation")
    ap.add_argument("--out", type=Path, default=RESULTS / "vllm_weight_path.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # a JSON spec: run one engine and print its figures
    args = ap.parse_args()
    if args.child:
        return child_main(json.loads(args.child))
    if args.quick:
        args.repeats, args.gen_repeats = 1, 1
    t_start = time.time()
    trees = {"old": str(old_tree()), "new": str(ROOT)}
    models = build_models(args)
    common = {"kv_cache_gib": args.kv_cache_gib, "updates": args.updates}
    runs: dict = {"sync": {name: {"old": [], "new": []} for name in models}, "generate": {"1": [], "2": []}}
    for rnd in range(args.repeats):
        order = ("old", "new") if rnd % 2 == 0 else ("new", "old")  # drift in the machine's load hits both
        for name, (path, _) in models.items():
            for code in order:
                spec = {"task": "sync", "code": trees[code], "model": path, "label": f"{code} {name}", **common}
                r = run_child(spec)
                runs["sync"][name][code].append(r)
                print(
                    f"[bench] round {rnd + 1} {code} {name}: start-up {r['startup_s']:.0f} s, updates "
                    + ", ".join(f"{x:.3f}" for x in r["update_s"])
                    + f" s, RSS {r['after_startup']['rss_mib']:.0f} -> {r['after_updates']['rss_mib']:.0f} MiB",
                    flush=True,
                )
        for tp in (1, 2) if rnd % 2 == 0 else (2, 1):
            spec = {"task": "generate", "code": trees["new"], "model": models["tiny"][0], "label": f"TP {tp}"}
            spec |= {"tp": tp, "requests": args.requests, "max_new": args.max_new, "gen_repeats": args.gen_repeats}
            r = run_child(spec | common)
            runs["generate"][str(tp)].append(r)
            tps = ", ".join(f"{x:.0f}" for x in r["tokens_per_s"])
            print(f"[bench] round {rnd + 1} TP {tp}: start-up {r['startup_s']:.0f} s, {tps} tokens/s", flush=True)
    summary = summarise(runs, models)
    # what a host mirror costs a generator at the sizes users run (params x 2 bytes in bf16)
    summary["mirror_at_scale"] = {f"{b}B": {"params": b * 10**9, "bytes": 2 * b * 10**9} for b in (7, 32)}
    print_table(summary, args)
    from areal_hpc.utils import atomic_write_text

    result = {
        "benchmark": "vllm_weight_path",
        "host": platform.node(),
        "time": time.time(),
        "wall_s": time.time() - t_start,
        "old_commit": OLD_COMMIT,
        "args": {k: str(v) for k, v in vars(args).items() if k != "child"},
        "models": {name: shape for name, (_, shape) in models.items()},
        "runs": runs,
        **summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
