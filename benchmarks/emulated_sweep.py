"""Planning figures: the simulator on AReaL's 1.5B shape (eta sweep, each rollout.weight_update mode) beside
AReaL's table; with --emulated instead, the emulated cluster (the real runtime, 16 generators + 5 trainers)
at the --variants asked for (eta and weight-update mode), each against the simulator's prediction for the
same config.

    python benchmarks/emulated_sweep.py [--versions 12] [--emulated] [--out benchmarks/results/emulated_sweep.json]

The paper's shape: 128 GPUs, 96 generating and 32 training; 512 prompts x 16 answers per version. The
length distribution (log-normal, median 6k tokens, capped at 27k) is an assumption, not a measured one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.costmodel import ResponseLengths  # noqa: E402
from areal_hpc.simulate import sim_config, simulate  # noqa: E402
from areal_hpc.utils import atomic_write_text  # noqa: E402

AREAL_ETA_KTOK = {0: 128.7, 1: 269.3, 2: 356.6, 4: 356.6, 8: 371.7, 16: 382.4, "unbounded": 396.8}
UNBOUNDED = 10**6  # the gate never binds
MODES = ("keep_kv", "recompute", "drain")  # rollout.weight_update


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
    ap.add_argument("--versions", type=int, default=12)
    ap.add_argument(
        "--emulated", action="store_true", help="instead: the emulated cluster's runs (minutes), emulated_cluster.json"
    )
    ap.add_argument(
        "--variants",
        default="eta0,eta4_keep_kv,eta4_recompute,eta4_drain",
        help=f"with --emulated: etaN[_MODE] or unbounded; MODE one of {', '.join(MODES)} (default: the config's)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "emulated_sweep.json"))
    args = ap.parse_args()
    if args.emulated:
        out = Path(args.out).with_name("emulated_cluster.json")
        # points already measured are kept: the runs take minutes each, so a sweep can be run in parts
        done = json.loads(out.read_text()) if out.is_file() else {}
        for name, row in emulated_runs(args.variants.split(",")):
            done[name] = row
            write_emulated(out, done)  # after every point: a sweep stopped midway keeps what it measured
        return
    base = paper_shape(args.versions)
    rows = []
    for eta in (0, 1, 2, 4, 8, 16, "unbounded"):
        for mode in MODES:
            r = simulate(replace(base, eta=UNBOUNDED if eta == "unbounded" else eta, weight_update=mode))
            rows.append({"eta": eta, "weight_update": mode, **r.row()})
            print(
                f"eta={eta!s:>9} {mode:<9}  {r.consumed_tokens_per_s / 1e3:7.1f}k tok/s "
                f"(second half {r.steady_tokens_per_s / 1e3:5.0f}k) "
                f"(AReaL {AREAL_ETA_KTOK[eta]}k)  gen busy {r.gen_busy:.0%}  train busy {r.train_busy:.0%}  "
                f"staleness mean {r.row()['staleness_mean']:.2f}",
                flush=True,
            )
    result = summarize(rows, args.versions)
    print("ratio to eta 0, simulated vs AReaL:")
    for k, v in result["ratio_to_eta0"].items():
        print(f"  eta={k:>9}  {v:.2f}  vs {result['areal_ratio_to_eta0'][k]:.2f}")
    for mode in MODES:
        gain = {k: round(v, 3) for k, v in result["over_recompute"][mode].items()}
        print(f"{mode} / recompute, consumed tokens/s by eta:", gain)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {out}")


def write_emulated(out: Path, done: dict) -> None:
    """The emulated points so far, with the ratios that both of their points make."""
    points = {k: v for k, v in done.items() if isinstance(v, dict) and "measured_tokens_per_s" in v}
    for name, row in points.items():  # each mode against recompute at the same eta, and each eta against eta 0
        eta, _, mode = name.partition("_")
        if mode and (base := points.get(f"{eta}_recompute")):
            done[f"{mode}_over_recompute_{eta}"] = row["measured_tokens_per_s"] / base["measured_tokens_per_s"]
        if name != "eta0" and "eta0" in points:
            done[f"{name}_over_eta0"] = row["measured_tokens_per_s"] / points["eta0"]["measured_tokens_per_s"]
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(done, indent=1, default=float))
    print(f"wrote {out}", flush=True)


def summarize(rows: list[dict], versions: int) -> dict:
    """Ratios to eta=0 (keep_kv) and each mode against recompute, on consumed tokens/s over the whole run
    (as AReaL's table).

    The second-half ("steady") figure is in the rows too, but with few versions a large eta eats in the
    second half the backlog it generated in the first, so it overstates what a long run would sustain."""
    by = {m: {r["eta"]: r["consumed_tokens_per_s"] for r in rows if r["weight_update"] == m} for m in MODES}
    on = by["keep_kv"]
    return {
        "shape": {"gen_gpus": 96, "train_gpus": 32, "batch_prompts": 512, "n_samples": 16, "versions": versions},
        "rows": rows,
        "areal_ktok_per_s": {str(k): v for k, v in AREAL_ETA_KTOK.items()},
        "ratio_to_eta0": {str(k): v / on[0] for k, v in on.items()},
        "areal_ratio_to_eta0": {str(k): v / AREAL_ETA_KTOK[0] for k, v in AREAL_ETA_KTOK.items()},
        "over_recompute": {m: {str(k): v / by["recompute"][k] for k, v in by[m].items()} for m in MODES},
    }


SEEDS = 8


def _expected(sim) -> tuple[float, tuple[float, float]]:
    """The simulator's consumed tokens/s as the mean over SEEDS draws of the lengths, with their range.

    A run is one draw: in 8 versions, which answers run long and how many uniform groups are refilled
    in series move one simulated run by up to +-10% (eta 0), so one seed is not a prediction."""
    runs = [simulate(replace(sim, seed=s)).consumed_tokens_per_s for s in range(SEEDS)]
    return sum(runs) / len(runs), (min(runs), max(runs))


def _variant(name: str) -> list[str]:
    """'eta4_drain' -> the overrides of that point ('unbounded': a gate that never binds; no mode: the config's)."""
    eta, _, mode = name.partition("_")
    value = UNBOUNDED if eta in ("unbounded", "etaunbounded") else int(eta.removeprefix("eta"))
    if mode and mode not in MODES:
        raise SystemExit(f"variant {name!r}: {mode!r} is not a weight-update mode; choose one of {', '.join(MODES)}")
    return [f"rollout.eta={value}"] + ([f"rollout.weight_update={mode}"] if mode else [])


def emulated_runs(variants: list[str]):
    """The real runtime with emulated engines at 16 + 5 ranks, one run per variant, each beside its
    prediction; yields (variant, figures) as each run ends."""
    from areal_hpc.launch.local import launch
    from areal_hpc.runtime.comm.timeline import load_timeline
    from areal_hpc.simulate import calibrate, trained_span_tokens_per_s

    work = ROOT / "runs" / "bench-emulated"
    for name in variants:
        extra = _variant(name)
        cfg = load_config(
            ROOT / "jobs" / "emulated_1p5b.yaml",
            [f"store.run_dir={work / name}", "logging.progress=false", "trainer.versions=8", *extra],
        )
        shutil.rmtree(work / name, ignore_errors=True)  # a scratch run of this variant from an earlier sweep
        s = launch(cfg, progress=False)
        scale = cfg.emulation.time_scale  # wall seconds per modelled second
        predicted, spread = _expected(sim_config(cfg))
        # over the span the simulator models (first weights published -> last version trained); the
        # summary's figure also counts the final evaluation and the shutdown
        measured = trained_span_tokens_per_s(work / name) * scale
        tl = load_timeline(work / name)
        gen_s = tl[(tl.role == "generator") & (tl.event == "generate")].duration.sum()
        calibrated, _ = calibrate(work / name)
        self_pred, self_spread = _expected(calibrated)
        self_pred *= scale  # its costs are in wall seconds
        row = {
            "measured_tokens_per_s": measured,
            "predicted_tokens_per_s": predicted,
            "error": predicted / measured - 1,
            "error_range": [x / measured - 1 for x in spread],
            "calibrated_self_error": self_pred / measured - 1,
            "calibrated_self_error_range": [x * scale / measured - 1 for x in self_spread],
            # over the same span: tokens consumed / measured tokens per modelled second, in wall seconds
            "gen_generating": gen_s * measured / (cfg.cluster.n_generators * s["tokens_consumed"] * scale),
        }
        print(
            f"emulated {name}: {measured:.0f} tok/s (modelled time); cost-model simulation "
            f"{predicted:.0f} ({row['error']:+.1%}, seeds {row['error_range'][0]:+.1%}..{row['error_range'][1]:+.1%});"
            f" simulation calibrated on the run {row['calibrated_self_error']:+.1%}; generators generating "
            f"{row['gen_generating']:.0%} of the RL time",
            flush=True,
        )
        yield name, row


if __name__ == "__main__":
    main()
