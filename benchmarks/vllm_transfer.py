"""vLLM's weight-transfer path as a run uses it, with no MPI: a trainer process sends weights to every worker of a
tensor-parallel vLLM generator (engines/vllm_transfer.py: gloo on CPU, vLLM's nccl engine on GPUs), several
versions; prints sync seconds per GB, whether every token's version (vLLM's stamp) and every checksum equals what
was sent, and tokens/s.

    .venv/bin/python benchmarks/vllm_transfer.py --tp 1 2                      # CPU, the tiny model (~2 minutes)
    python3 benchmarks/vllm_transfer.py --device cuda --dtype bfloat16 --tp 1 2 --hidden 2048 --layers 16 \\
        --heads 16                                                             # the GPU check (gpu_weight_loads.sh)
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a bare checkout too (the GPU machine has no install of this package)


def _weights(model_dir: str, dtype: str, version: int) -> dict:
    import torch

    from areal_hpc.model import load_causal_lm

    model = load_causal_lm(model_dir, dtype).eval()
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():  # through the parameters: a tied head stays tied
        for p in model.parameters():
            p.add_((0.01 * torch.randn(p.shape, generator=g)).to(p.dtype))
    return model.state_dict()


def _sync(port: int, rank: int):
    """The two things of a run's SyncGroup the transfer groups use: its store and this end's rank (generator: 1)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=600))
    return SimpleNamespace(store=store, rank=rank, size=2)


def trainer(port: int, tp: int, args, model_dir: str, q) -> None:
    """Trainer 0's side, as in a run (transfer_groups): gloo from host buckets on CPU, vLLM's NCCL trainer endpoint
    from GPU buckets on cuda; each version's buckets posted on the generator's group."""
    from areal_hpc.model.weights import weights_checksum
    from areal_hpc.runtime.comm.transfer_groups import NcclTransferGroups, TransferGroups, transfer_backend
    from areal_hpc.runtime.comm.weight_sync import BucketPlan

    if args.device == "cuda":
        import torch

        torch.cuda.set_device(tp)  # the GPU after the generator's tp: NCCL wants one rank per GPU
    nccl = transfer_backend(args.device) == "nccl"
    groups = (NcclTransferGroups if nccl else TransferGroups)(_sync(port, 0), tp, 600)
    plan = None
    for v in range(1, args.versions + 1):
        sd = _weights(model_dir, args.dtype, v)
        plan = plan or BucketPlan(sd, args.bucket_mb << 20, groups.device)
        plan.pack(sd)
        t0 = time.time()
        for w in groups.post(plan):
            w.wait(datetime.timedelta(seconds=600))
        q.put({"version": v, "send_s": time.time() - t0, "checksum": weights_checksum(plan.views())})
    groups.close()


def run_tp(args, model_dir: str, tp: int) -> dict:
    import torch.distributed as dist

    from areal_hpc.engines.base import generate
    from areal_hpc.engines.vllm_gen import VLLMGenerationEngine
    from areal_hpc.model import load_tokenizer
    from areal_hpc.runtime.comm.transfer_groups import transfer_backend, update_fields, worker_init_info
    from areal_hpc.runtime.comm.weight_sync import BucketPlan, published_layout
    from areal_hpc.types import GenRequest

    eng = VLLMGenerationEngine(
        model_dir, dtype=args.dtype, device=args.device, tensor_parallel=tp, kv_cache_gib=args.kv_cache_gib
    )
    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=600), wait_for_workers=False)
    plan = BucketPlan(published_layout(model_dir, args.dtype), args.bucket_mb << 20, "meta")
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=trainer, args=(store.port, tp, args, model_dir, q))
    proc.start()
    backend = transfer_backend(args.device)
    eng.connect(worker_init_info(_sync(store.port, 1), plan, tp, 600, backend))
    wire = {"checksum": True} | update_fields(plan, backend)
    tok = load_tokenizer(model_dir)
    eng.ignore_eos = True
    reqs = [GenRequest(f"r{i}", tok.encode("12+34="), args.max_new) for i in range(args.requests)]
    eng.add(reqs)
    loads, steps, outs, t_gen = [], 0, [], 0.0
    while len(outs) < len(reqs):
        if steps % args.load_every == args.load_every - 1 and len(loads) < args.versions:
            t0 = time.time()
            eng.load(wire, len(loads) + 1, keep_kv=True)  # mid-answer: keep_kv, vLLM's "keep"
            loads.append({"load_s": time.time() - t0, "checksum": eng.weights_checksum()})
        t0 = time.time()
        done = eng.step()
        t_gen += time.time() - t0
        outs += done
        steps += 1
    while len(loads) < args.versions:
        t0 = time.time()
        eng.load(wire, len(loads) + 1)
        loads.append({"load_s": time.time() - t0, "checksum": eng.weights_checksum()})
    sent = [q.get(timeout=600) for _ in range(args.versions)]
    proc.join(60)
    tokens = sum(len(o.output_ids) for o in outs)
    (greedy,) = generate(eng, [GenRequest("g", tok.encode("1+2="), 8, greedy=True)])
    nbytes = plan.nbytes
    row = {
        "tp": tp,
        "bytes": nbytes,
        "sync_s_per_gb": [round(ld["load_s"] / (nbytes / 1e9), 3) for ld in loads],
        "checksums_equal": all(ld["checksum"] == s["checksum"] for ld, s in zip(loads, sent)),
        "versions_checked": eng.versions_checked,
        "versions_equal": eng.versions_mismatched == 0 and eng.versions_checked > 0,
        "interrupted": sum(o.finish_reason == "abort" for o in outs),
        "gen_tokens_per_s": round(tokens / t_gen, 1),
        "greedy_after_last": greedy.output_ids,
    }
    eng.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--load-every", type=int, default=8, help="engine steps between two mid-answer loads")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_transfer.json"))
    args = ap.parse_args()
    from areal_hpc.model import build_tiny_model
    from areal_hpc.utils import atomic_write_text

    shape = f"h{args.hidden}-l{args.layers}"
    model_dir = str(
        build_tiny_model(
            Path(args.out).parent / f"bench-llama-{shape}",
            arch="llama",
            seed=0,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
        )
    )
    tps = args.tp
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        tps = [tp for tp in args.tp if tp + 1 <= gpus]
        for tp in sorted(set(args.tp) - set(tps)):
            print(f"TP {tp}: skipped, it needs {tp + 1} GPUs (the trainer's own and the workers'), {gpus} visible")
    rows = [run_tp(args, model_dir, tp) for tp in tps]
    print(f"{'tp':>3} {'MB':>8} {'sync s/GB (per load)':>28} {'crc ok':>7} {'versions ok':>12} {'tok/s':>9}")
    for r in rows:
        print(
            f"{r['tp']:>3} {r['bytes'] / 1e6:>8.1f} {str(r['sync_s_per_gb']):>28} {str(r['checksums_equal']):>7} "
            f"{str(r['versions_equal']):>12} {r['gen_tokens_per_s']:>9}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(args.out), json.dumps({"host": platform.node(), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
