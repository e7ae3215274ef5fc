"""Training-inference mismatch on this project's engines: the staleness-0 gap between the logprobs a generation
engine recorded for the tokens it sampled and those the torch trainer computes for them with the same weights.

Each case samples at temperature 1 through a generation engine's own API (update_weights, add/step) and
recomputes the sampled tokens with `TorchTrainEngine.compute_logprobs` (the trainer's path: packed attention,
the chunked output layer); algo/mismatch.py turns the pairs into the figures metrics.csv logs per version
(k1, k3, chi2, log_ppl_diff, max_ratio, mult_prob_err, ess). Two models:

- `demo`: jobs/demo.yaml's tiny Llama after its warm start (built and warm-started here by the runtime's own
  warm_start), written as a model folder as a LoRA run writes its base; prompts from the demo's training set;
- `bench`: the Qwen2-shaped benchmark model of benchmarks/objective_cost.py (151,936 vocabulary, hidden 512,
  4 layers), random weights (so nearly flat distributions), random prompts, every answer run to --bench-new.

Cases (rows): torch and vLLM generation against the fp32 trainer; bf16 generation (torch, and vLLM where its
CPU build runs bf16) against the fp32 trainer and against the bf16 (autocast) trainer; the generator holding a
LoRA adapter merged into its base (engines/lora.py's AdapterMerger, as generators do under trainer.lora_rank)
against the trainer computing with the PEFT adapter unmerged (rank 8, alpha 32, trained --lora-updates PPO
versions at lr 1e-3 first); and a keep_kv load in flight: requests start under weights A, weights B (A after
one PPO version at --straddle-lr, random advantages) load after max_new/4 engine steps with the KV cache
kept, and the tokens sampled after the load (version B, over a cache A computed) are measured against the
trainer holding B (and against A, for how far B is from A there), apart from the same requests' tokens
sampled before it (version A, against the trainer holding A).

    flock /tmp/areal-heavy.lock .venv/bin/python benchmarks/mismatch_engines.py      # CPU, about 4 minutes
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a bare checkout too

from areal_hpc.algo.mismatch import FIGURES, gap_figures, gap_sums  # noqa: E402
from areal_hpc.engines.base import generate  # noqa: E402
from areal_hpc.types import GenRequest  # noqa: E402
from areal_hpc.utils import atomic_write_text  # noqa: E402
from tests.request_helpers import sample_request  # noqa: E402

SHOWN = ("k1", "k3", "chi2", "log_ppl_diff", "max_ratio", "mult_prob_err", "ess")


@dataclass
class Model:
    """A model folder whose weights every engine starts from, the prompts and how long answers may run."""

    name: str
    path: str
    prompts: list[list[int]]
    samples: int
    max_new: int
    ignore_eos: bool
    chunk: int = 256
    mb_tokens: int = 4096


def demo_model(work: Path, n_prompts: int, samples: int) -> Model:
    """jobs/demo.yaml's tiny Llama, warm-started by the runtime's warm_start, written as a model folder."""
    from areal_hpc.config import load_config
    from areal_hpc.data import load_run_dataset
    from areal_hpc.model import ensure_model, load_tokenizer
    from areal_hpc.runtime.build import build_train_engine, warm_start

    cfg = load_config(ROOT / "jobs" / "demo.yaml", [f"model.path={work / 'demo-init'}"])
    tok = load_tokenizer(ensure_model(cfg.model))
    ds = load_run_dataset(cfg, tok)
    tc = cfg.trainer
    trainer = build_train_engine(cfg, Path(cfg.model.path))
    warm_start(trainer, tok, ds, cfg, progress=False)
    path = trainer.export_hf(work / "demo-warm")
    prompts = [list(p.prompt_ids) for p in ds.train[:n_prompts]]
    return Model("demo", str(path), prompts, samples, cfg.rollout.max_new_tokens, False, tc.logprob_chunk_tokens)


def bench_model(work: Path, n_prompts: int, samples: int, max_new: int) -> Model:
    """benchmarks/objective_cost.py's Qwen2-shaped model (random weights), random 16-token prompts."""
    from train_memory import build_model

    path = build_model(work / "bench", argparse.Namespace(hidden=512, layers=4, heads=8))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 151_000, 16).tolist() for _ in range(n_prompts)]
    return Model("bench", str(path), prompts, samples, max_new, True)


# -- engines ------------------------------------------------------------------------------------------------
def gen_engine(kind: str, m: Model, dtype: str, seed: int = 0):
    from areal_hpc.engines import make_generation_engine

    extra = {"kv_cache_gib": 1.0} if kind == "vllm" else {}
    n = len(m.prompts) * m.samples
    eng = make_generation_engine(kind, model_path=m.path, dtype=dtype, seed=seed, max_num_seqs=n, **extra)
    eng.ignore_eos = m.ignore_eos
    return eng


def train_engine(m: Model, bf16: bool = False, lora=None, lr: float = 1e-4):
    from areal_hpc.engines.torch_train import TorchTrainEngine

    return TorchTrainEngine(
        m.path,
        lr=lr,
        weight_decay=0.0,
        bf16=bf16,
        lora=lora,
        logprob_chunk_tokens=m.chunk,
        max_tokens_per_mb=m.mb_tokens,
    )


def requests(m: Model) -> list[GenRequest]:
    return [
        GenRequest(sample_request(i, s), list(p), m.max_new) for i, p in enumerate(m.prompts) for s in range(m.samples)
    ]


# -- measuring ----------------------------------------------------------------------------------------------
def pairs(outs, trainer) -> dict[str, np.ndarray]:
    """Every sampled token: its behaviour logprob, the trainer's, its version and sequence, flattened."""
    seqs = [np.asarray(o.prompt_ids + o.output_ids, dtype=np.int64) for o in outs]
    train = trainer.compute_logprobs(seqs)
    return {
        "behav": np.concatenate([np.asarray(o.output_logprobs, np.float64) for o in outs]),
        "train": np.concatenate([lp[len(o.prompt_ids) :] for o, lp in zip(outs, train, strict=True)]),
        "version": np.concatenate([np.asarray(o.output_versions) for o in outs]),
        "seq": np.concatenate([np.full(len(o.output_ids), i) for i, o in enumerate(outs)]),
    }


def figures(p: dict, mask=None) -> dict:
    mask = np.ones(len(p["behav"]), bool) if mask is None else mask
    out = gap_figures(gap_sums(p["behav"], p["train"], mask, p["seq"]))
    out["nll"] = float(-p["behav"][mask].mean()) if mask.any() else float("nan")  # how peaked the sampled tokens are
    return out


def row(model: str, case: str, gen: str, train: str, figs: dict, note: str = "") -> dict:
    r = {"model": model, "case": case, "generation": gen, "training": train, **figs, "note": note}
    print(
        f"{model:<6}{case:<24}{figs['tokens']:>7.0f}"
        + "".join(f"{figs[k]:>11.2e}" for k in ("k1", "k3", "chi2", "log_ppl_diff"))
        + "".join(f"{figs[k]:>9.4f}" for k in ("max_ratio", "mult_prob_err", "ess"))
        + f"{figs['nll']:>7.3f}  {note}",
        flush=True,
    )
    return r


def sample(eng, m: Model, weights=None, version: int = 1):
    if weights is not None:
        eng.update_weights(weights, version)
    else:
        eng.version = version
    return generate(eng, requests(m))


def precision_rows(m: Model, vllm_bf16: bool) -> tuple[list[dict], list]:
    """Rows 1-4: torch and vLLM generation against the fp32 trainer, bf16 generation against fp32 and bf16."""
    t32, t16 = train_engine(m), train_engine(m, bf16=True)
    rows, first = [], None
    cases = [("torch", "float32"), ("vllm", "float32"), ("torch", "bfloat16")]
    cases += [("vllm", "bfloat16")] if vllm_bf16 else []
    for kind, dtype in cases:
        eng = gen_engine(kind, m, dtype)
        outs = sample(eng, m)
        eng.close()
        first = first or outs
        short = "fp32" if dtype == "float32" else "bf16"
        rows.append(row(m.name, f"{kind} {short} / fp32", f"{kind} {short}", "torch fp32", figures(pairs(outs, t32))))
        if dtype == "bfloat16":
            rows.append(
                row(m.name, f"{kind} bf16 / bf16", f"{kind} bf16", "torch bf16 autocast", figures(pairs(outs, t16)))
            )
    return rows, first


def lora_rows(m: Model, outs, updates: int, rank: int = 8, alpha: float = 32.0) -> list[dict]:
    """Row 5: an adapter trained `updates` PPO versions; the generator merges it, the trainer keeps it unmerged."""
    from areal_hpc.engines.lora import AdapterMerger, LoraSpec
    from tests.request_helpers import output_trajectory

    spec = LoraSpec(rank, alpha)
    tl = train_engine(m, lora=spec, lr=1e-3)
    trajs = [output_trajectory(o, o.request_id.episode.group_id, 0.0) for o in outs]
    rng = np.random.default_rng(1)
    for _ in range(updates):  # random advantages: an Adam step's size does not depend on them
        tl.ppo_update(trajs, rng.standard_normal(len(trajs)).astype(np.float32))
    adapter = {k: v.detach().clone() for k, v in tl.weights().items()}
    eng = gen_engine("torch", m, "float32")
    merger = AdapterMerger(eng.state_dict(), sorted({k.rsplit(".lora_", 1)[0] for k in adapter}), spec.scale)
    got = sample(eng, m, merger.merged(adapter), version=tl.version)
    p = pairs(got, tl)
    shift = figures({**p, "train": pairs(got, train_engine(m))["train"]})["k1"]  # the adapter's own effect
    note = f"rank {rank}, alpha {alpha:g}, {updates} PPO versions at lr 1e-3 (adapter vs base: k1 {shift:.2e})"
    return [row(m.name, "lora merged / unmerged", "torch fp32, merged", "torch fp32, PEFT adapter", figures(p), note)]


def straddle_rows(m: Model, kind: str, outs, lr: float, load_after: int) -> list[dict]:
    """Row 6: weights B load with keep_kv after `load_after` engine steps of requests started under A."""
    from tests.request_helpers import output_trajectory

    trainer = train_engine(m, lr=lr)
    a = {k: v.detach().clone() for k, v in trainer.weights().items()}
    trajs = [output_trajectory(o, o.request_id.episode.group_id, 0.0) for o in outs]
    adv = np.random.default_rng(2).standard_normal(len(trajs)).astype(np.float32)
    trainer.ppo_update(trajs, adv)  # one version at lr: B
    b = {k: v.detach().clone() for k, v in trainer.weights().items()}
    # another seed than the samples B was trained on: the same seed would replay exactly those tokens under A
    eng = gen_engine(kind, m, "float32", seed=1)
    eng.version = 1
    eng.add(requests(m))
    done = []
    for _ in range(load_after):
        done += eng.step()
    eng.update_weights(b, 2, keep_kv=True)
    while eng.num_running or eng.num_waiting:
        done += eng.step()
    eng.close()
    p_b = pairs(done, trainer)  # the trainer holds B
    trainer.model.load_state_dict(a)
    p_a = pairs(done, trainer)  # ... and now A
    seq_has_a = np.isin(p_b["seq"], np.unique(p_b["seq"][p_b["version"] == 1]))
    after = (p_b["version"] == 2) & seq_has_a  # sampled by B over a cache A computed
    before = (p_b["version"] == 1) & np.isin(p_b["seq"], p_b["seq"][after])
    fresh = (p_b["version"] == 2) & ~seq_has_a
    where = f"load after {load_after} steps, B = A + 1 PPO version at lr {lr:g}"
    rows = [
        row(m.name, f"{kind} keep_kv: after load", kind, "torch fp32 holding B", figures(p_b, after), where),
        row(
            m.name,
            f"{kind} keep_kv: after, vs A",
            kind,
            "torch fp32 holding A",
            figures(p_a, after),
            "the same tokens against A: how far B is from A there",
        ),
        row(
            m.name,
            f"{kind} keep_kv: before load",
            kind,
            "torch fp32 holding A",
            figures(p_a, before),
            "the same requests' tokens sampled before the load",
        ),
    ]
    if fresh.any():
        rows.append(
            row(
                m.name,
                f"{kind} keep_kv: started after",
                kind,
                "torch fp32 holding B",
                figures(p_b, fresh),
                "requests prefilled after the load",
            )
        )
    return rows


def vllm_runs_bf16(m: Model) -> bool:
    try:
        gen_engine("vllm", m, "bfloat16").close()
        return True
    except Exception as err:  # noqa: BLE001  (a CPU build without bf16 kernels: the torch engine covers it)
        print(f"[mismatch] vLLM bf16 on this machine: {type(err).__name__}: {str(err)[:200]}", flush=True)
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,bench")
    ap.add_argument("--demo-prompts", type=int, default=64, help="demo prompts, each sampled --demo-samples times")
    ap.add_argument("--demo-samples", type=int, default=8)
    ap.add_argument("--bench-prompts", type=int, default=8)
    ap.add_argument("--bench-samples", type=int, default=4)
    ap.add_argument("--bench-new", type=int, default=48, help="tokens sampled per bench answer (EOS ignored)")
    ap.add_argument("--lora-updates", type=int, default=2, help="PPO versions that train the adapter first")
    ap.add_argument("--straddle-lr", type=float, default=1e-4, help="the version B is A plus (demo's trainer.lr)")
    ap.add_argument("--straddle-engines", default="torch,vllm")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mismatch_engines.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    print(
        f"{'model':<6}{'case':<24}{'tokens':>7}"
        + "".join(f"{k:>11}" for k in ("k1", "k3", "chi2", "log_ppl"))
        + "".join(f"{k:>9}" for k in ("max_rat", "mult_err", "ess"))
        + f"{'nll':>7}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "demo":
                m = demo_model(Path(tmp), args.demo_prompts, args.demo_samples)
            else:
                m = bench_model(Path(tmp), args.bench_prompts, args.bench_samples, args.bench_new)
            got, outs = precision_rows(m, vllm_runs_bf16(m))
            rows += got
            rows += lora_rows(m, outs, args.lora_updates)
            for kind in args.straddle_engines.split(","):
                rows += straddle_rows(m, kind, outs, args.straddle_lr, max(1, m.max_new // 4))
    result = {
        "benchmark": "mismatch_engines",
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "seconds": time.perf_counter() - t0,
        "args": {k: str(v) for k, v in vars(args).items()},
        "figures": [*FIGURES, "nll"],
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
