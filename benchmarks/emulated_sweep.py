"""Planning figures: the simulator on AReaL's 1.5B shape (eta sweep, interruption on and off) beside AReaL's
table, and optionally the emulated cluster (the real runtime, 16 generators + 5 trainers) at eta 0 and 4
against the simulator's prediction for the same config.

    python benchmarks/emulated_sweep.py [--versions 6] [--emulated] [--out benchmarks/results/emulated_sweep.json]

The paper's shape: 128 GPUs, 96 generating and 32 training; 512 prompts x 16 answers per version. The
length distribution (log-normal, median 6k tokens, capped at 27k) is an assumption, not a measured one.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.costmodel import ResponseLengths  # noqa: E402
from areal_hpc.simulate import sim_config, simulate  # noqa: E402

AREAL_ETA_KTOK = {0: 128.7, 1: 269.3, 2: 356.6, 4: 356.6, 8: 371.7, 16: 382.4, "unbounded": 396.8}
UNBOUNDED = 10**6  # the gate never binds


def paper_shape(versions: int):
    cfg = load_config(
        ROOT / "jobs" / "emulated_1p5b.yaml",
        [
            "cluster.n_generators=96",
            "cluster.n_trainers=32",
            "rollout.batch_prompts=512",
            "rollout.max_num_seqs=256",
            "rollout.max_new_tokens=27648",
            f"trainer.versions={versions}",
        ],
    )
    return replace(sim_config(cfg), lengths=ResponseLengths(6000, 0.9, 27648), prompt_len=200)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--emulated", action="store_true", help="also run the emulated cluster (minutes)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "emulated_sweep.json"))
    args = ap.parse_args()
    base = paper_shape(args.versions)
    rows = []
    for eta in (0, 1, 2, 4, 8, 16, "unbounded"):
        for interrupt in (True, False):
            if not interrupt and eta not in (4, "unbounded"):
                continue
            r = simulate(replace(base, eta=UNBOUNDED if eta == "unbounded" else eta, interrupt=interrupt))
            rows.append({"eta": eta, "interrupt": interrupt, **r.row()})
            print(
                f"eta={eta!s:>9} interrupt={interrupt!s:5}  {r.consumed_tokens_per_s / 1e3:7.1f}k tok/s "
                f"(AReaL {AREAL_ETA_KTOK[eta]}k)  gen busy {r.gen_busy:.0%}  train busy {r.train_busy:.0%}  "
                f"staleness mean {r.row()['staleness_mean']:.2f}",
                flush=True,
            )
    on = {r["eta"]: r["consumed_tokens_per_s"] for r in rows if r["interrupt"]}
    off = {r["eta"]: r["consumed_tokens_per_s"] for r in rows if not r["interrupt"]}
    result = {
        "shape": {"gen_gpus": 96, "train_gpus": 32, "batch_prompts": 512, "n_samples": 16, "versions": args.versions},
        "rows": rows,
        "areal_ktok_per_s": {str(k): v for k, v in AREAL_ETA_KTOK.items()},
        "ratio_to_eta0": {str(k): v / on[0] for k, v in on.items()},
        "areal_ratio_to_eta0": {str(k): v / AREAL_ETA_KTOK[0] for k, v in AREAL_ETA_KTOK.items()},
        "interruption_gain": {str(k): on[k] / off[k] for k in off},
    }
    if args.emulated:
        result["emulated"] = emulated_runs()
    print("ratio to eta 0, simulated vs AReaL:")
    for k in on:
        print(f"  eta={k!s:>9}  {result['ratio_to_eta0'][str(k)]:.2f}  vs {result['areal_ratio_to_eta0'][str(k)]:.2f}")
    print("interruption gain (on / off):", {k: round(v, 3) for k, v in result["interruption_gain"].items()})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {out}")


def emulated_runs() -> dict:
    """The real runtime with emulated engines at 16 + 5 ranks, eta 0 and 4, each beside its prediction."""
    from areal_hpc.launch.local import launch

    out = {}
    work = ROOT / "runs" / "bench-emulated"
    for name, extra in {
        "eta0": ["rollout.eta=0"],
        "eta4": ["rollout.eta=4"],
        "eta4_no_interrupt": ["rollout.eta=4", "rollout.interrupt=false"],
    }.items():
        cfg = load_config(
            ROOT / "jobs" / "emulated_1p5b.yaml",
            [f"store.run_dir={work / name}", "logging.progress=false", "trainer.versions=8", *extra],
        )
        s = launch(cfg, progress=False)
        scale = cfg.emulation.time_scale  # wall seconds per modelled second
        predicted = simulate(sim_config(cfg))
        measured = s["consumed_tokens_per_s"] * scale
        out[name] = {
            "measured_tokens_per_s": measured,
            "predicted_tokens_per_s": predicted.consumed_tokens_per_s,
            "error": predicted.consumed_tokens_per_s / measured - 1,
            "predicted_gen_busy": predicted.gen_busy,
        }
        print(f"emulated {name}: {measured:.0f} tok/s (modelled time), simulated {predicted.consumed_tokens_per_s:.0f}")
    out["async_over_sync"] = out["eta4"]["measured_tokens_per_s"] / out["eta0"]["measured_tokens_per_s"]
    out["interruption_gain"] = out["eta4"]["measured_tokens_per_s"] / out["eta4_no_interrupt"]["measured_tokens_per_s"]
    return out


if __name__ == "__main__":
    main()
