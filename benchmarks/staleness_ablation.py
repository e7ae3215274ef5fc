"""The paper's staleness ablation in shape, on the CPU demo task: held-out accuracy against eta for the
decoupled objective and plain PPO, the three weight-update modes at eta 4, the proximal recompute
against the log-linear approximation, and the objective menu at eta 4 (DAPO, Dr.GRPO, GSPO, TIS, KL, entropy:
`eta4_<name>`), with several seeds per point and the same number of versions.

Each point runs `jobs/demo.yaml` (2 generators + 1 trainer, a tiny Llama learning addition) for
--versions versions with no wall-time cap, evaluating every --eval-every versions; a seed sets both the
trainer's and the data's seed. `--setting harsh` runs every point with a larger learning rate and more
minibatches per version, where the policy moves far between versions and staleness should hurt plain
PPO; `--setting gentle` with half the optimizer steps per version. The JSON is written after every run
and runs already in it are kept, so the grid can be run in parts (`--points`, `--seeds`); 2-4 minutes a
run on 2 cores.

    .venv/bin/python benchmarks/staleness_ablation.py --points eta0,eta2,eta4,eta8 --seeds 0,1,2
    .venv/bin/python benchmarks/staleness_ablation.py --table          # the table of what is measured
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from _runs import launch_run  # benchmarks/ is on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# AReaL (arXiv 2505.24298), 1.5B, AIME24: the synchronous run 42.0; with the decoupled objective 41-42
# for every eta up to 8; plain PPO 23.3 at eta 4
PAPER = {"sync": 42.0, "decoupled_eta_le_8": (41.0, 42.0), "plain_eta4": 23.3}

ETAS = (0, 1, 2, 4, 8, 16)
MODES = ("keep_kv", "recompute", "drain")


def grid() -> dict[str, list[str]]:
    """Point name -> its overrides of the demo config (the default weight update unless the name says)."""
    points = {}
    for eta in ETAS:
        points[f"eta{eta}"] = [f"rollout.eta={eta}"]
        if eta:
            points[f"eta{eta}_plain"] = [f"rollout.eta={eta}", "ppo.decoupled=false"]
    for mode in MODES:
        points[f"eta4_{mode}"] = ["rollout.eta=4", f"rollout.weight_update={mode}"]
    for eta in (4, 8):
        points[f"eta{eta}_loglinear"] = [f"rollout.eta={eta}", "ppo.prox=loglinear"]
    for name, overrides in OBJECTIVES.items():
        points[f"eta4_{name}"] = ["rollout.eta=4", *overrides]
    for name, overrides in CORRECTIONS.items():
        points[f"eta0_{name}"] = ["rollout.eta=0", *overrides]
    return points


# the objective menu (docs/algorithm.md) at eta 4, each with the settings its paper reports where the demo allows
OBJECTIVES = {
    # DAPO: clip-higher 0.28, the soft overlong penalty over the last quarter of the answer budget (8 tokens
    # here), token-level loss and dynamic sampling (both already the demo's)
    "dapo": ["ppo.eps_clip_high=0.28", "reward.overlong_buffer=2", "reward.overlong_penalty=1.0"],
    # Dr.GRPO: no std normalisation, token sums over a constant (sequences x rollout.max_new_tokens)
    "drgrpo": ["ppo.adv_norm=mean", "ppo.loss_agg=seq_mean_token_sum_norm"],
    # GSPO: sequence ratios clipped to [1 - 3e-4, 1 + 4e-4], sequence-mean loss
    "gspo": [
        "ppo.importance=sequence",
        "ppo.eps_clip=3e-4",
        "ppo.eps_clip_high=4e-4",
        "ppo.loss_agg=seq_mean_token_mean",
    ],
    # truncated importance sampling: the behaviour weight clamped at 2 instead of dropping the token
    "tis": ["ppo.behav_weight=truncate", "ppo.behav_imp_weight_cap=2"],
    # GRPO's KL to the reference (k3, beta 0.04)
    "kl": ["ppo.kl_coef=0.04", "ppo.kl_estimator=k3"],
    "entropy": ["ppo.entropy_coef=0.001"],
    # CISPO: every token keeps its gradient, the ratio clipped above only (MiniMax-M1's eps_high)
    "cispo": ["ppo.objective=cispo", "ppo.eps_clip=1.0", "ppo.eps_clip_high=0.28"],
}

# the corrections for a training-inference mismatch, on fresh data (eta 0: every gap is mismatch, none staleness);
# run them under --setting mismatch, where generation rounds its weights to 4 bits, at a high learning rate
CORRECTIONS = {
    "plain": ["ppo.decoupled=false"],  # no correction: the ratio to the sampler's logprobs, nothing weighted
    "nocap": ["ppo.behav_imp_weight_cap=0"],  # the behaviour weight applied, never capped
    "drop": ["ppo.behav_imp_weight_cap=2"],
    "truncate": ["ppo.behav_weight=truncate", "ppo.behav_imp_weight_cap=2"],
    "seqreject": ["ppo.behav_imp_weight_cap=0", "ppo.seq_reject_low=0.5", "ppo.seq_reject_high=2"],
    "cispo": OBJECTIVES["cispo"],
}


# settings every point can run under: the demo's own; one where the policy moves far between versions
# (staleness should hurt plain PPO); one where it moves half as far (fewer optimizer steps per version)
SETTINGS = {
    "demo": [],
    "harsh": ["trainer.lr=4e-4", "ppo.n_minibatches=8"],
    "gentle": ["ppo.n_minibatches=2"],
    # generation on weights rounded to 4 bits per row (k3 ~0.02 against the trainer, bf16 gives ~1e-5), and the
    # policy moving far between versions
    "mismatch": ["rollout.weight_bits=4", "trainer.lr=4e-4", "ppo.n_minibatches=8"],
    # 3 bits: k3 ~0.3 against the trainer, a mismatch far past any peer's bar
    "mismatch3": ["rollout.weight_bits=3", "trainer.lr=4e-4", "ppo.n_minibatches=8"],
}


def run_point(name: str, overrides: list[str], seed: int, args) -> dict:
    import pandas as pd

    from areal_hpc.store import load_trajectories

    run_dir = args.out / f"{name}-s{seed}"
    ov = [
        *overrides,
        *SETTINGS[args.setting],
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"trainer.versions={args.versions}",
        "trainer.max_wall_s=0",
        "trainer.checkpoint_every=0",
        f"logging.eval_every={args.eval_every}",
        "logging.trackers=[]",
        "logging.progress=false",
    ]
    _, s = launch_run(run_dir, ov, args.out / "model")  # the same initial weights for every run
    m = pd.read_csv(run_dir / "metrics.csv")
    curve = m.dropna(subset=["heldout_acc"])[["version", "wall_s", "heldout_acc"]]
    eaten = load_trajectories(run_dir)
    eaten = eaten[eaten["consumed_version"] >= 0]
    stale = eaten["staleness"].value_counts().sort_index()
    return {
        "acc_start": s["acc_start"],
        "acc_final": s["acc_final"],
        "rl_wall_s": s["rl_wall_s"],
        "versions": s["versions"],
        "curve": curve.to_dict(orient="list"),
        "staleness": {int(k): int(v) for k, v in stale.items()},
        "staleness_mean": float(eaten["staleness"].mean()),
        "mixed_versions": float((eaten["version_start"] != eaten["version_end"]).mean()),
        "prefill_tokens": s.get("prefill_tokens"),
        # the training-inference gap, staleness-0 tokens and all tokens, as the version rows give it
        **{f"{c}_mean": float(m[c].mean()) for c in m.columns if c.startswith(("mismatch_", "offpolicy_"))},
    }


def _time_to(curve: dict, target: float) -> float:
    """Wall seconds at the first evaluation reaching `target` (nan: never)."""
    for wall, acc in zip(curve["wall_s"], curve["heldout_acc"], strict=True):
        if acc >= target - 1e-9:
            return wall
    return math.nan


def table(done: dict) -> list[dict]:
    """One row per point: final accuracy's mean and spread over seeds, against the synchronous run of the
    same seed (eta0) at equal versions, mean staleness, and wall time."""
    rows = []
    sync = done.get("eta0", {})
    for name, seeds in done.items():
        finals = [r["acc_final"] for r in seeds.values()]
        paired = [r["acc_final"] - sync[s]["acc_final"] for s, r in seeds.items() if s in sync]
        # the first evaluation at which this run reached its seed's synchronous final accuracy (nan: never)
        reach = [_time_to(r["curve"], sync[s]["acc_final"]) for s, r in seeds.items() if s in sync]
        rows.append(
            {
                "point": name,
                "seeds": len(finals),
                "acc_final_mean": statistics.fmean(finals),
                "acc_final_sd": statistics.stdev(finals) if len(finals) > 1 else math.nan,
                "vs_sync_points": 100 * statistics.fmean(paired) if paired else math.nan,
                "staleness_mean": statistics.fmean(r["staleness_mean"] for r in seeds.values()),
                "rl_wall_s": statistics.fmean(r["rl_wall_s"] for r in seeds.values()),
                "reached_sync_final": sum(not math.isnan(t) for t in reach),
                "wall_to_sync_final_s": statistics.fmean(reach) if reach else math.nan,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    keys = ("seeds", "acc_final_mean", "acc_final_sd", "vs_sync_points", "staleness_mean", "rl_wall_s")
    keys += ("reached_sync_final",)
    print(f"\n{'point':<18}" + "".join(f"{k:>20}" for k in keys) + f"{'to sync final s':>20}")
    for r in rows:
        print(f"{r['point']:<18}" + "".join(f"{r[k]:>20.3f}" for k in keys) + f"{r['wall_to_sync_final_s']:>20.1f}")
    print(
        f"AReaL 1.5B (AIME24): sync {PAPER['sync']}; decoupled {PAPER['decoupled_eta_le_8'][0]}-"
        f"{PAPER['decoupled_eta_le_8'][1]} for every eta <= 8; plain PPO {PAPER['plain_eta4']} at eta 4"
    )


def main() -> None:
    from areal_hpc.utils import atomic_write_text

    points = grid()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=",".join(points), help=f"a subset of {', '.join(points)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--versions", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument(
        "--setting",
        default="demo",
        choices=tuple(SETTINGS),
        help="; ".join(f"{k}: {' '.join(v) or 'jobs/demo.yaml as it is'}" for k, v in SETTINGS.items()),
    )
    ap.add_argument("--table", action="store_true", help="print the table of the runs in the JSON and stop")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tag = "staleness_ablation" if args.setting == "demo" else f"staleness_ablation_{args.setting}"
    tag += "" if args.versions == 150 else f"_v{args.versions}"  # one JSON holds one number of versions
    args.out = args.out or RESULTS / tag
    args.out.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{tag}.json"
    result = json.loads(path.read_text()) if path.is_file() else {"benchmark": tag, "runs": {}}
    result.update(versions=args.versions, setting=SETTINGS[args.setting], paper=PAPER)
    names = [p for p in args.points.split(",") if p]
    if unknown := [p for p in names if p not in points]:
        ap.error(f"unknown point {unknown[0]!r}; choose from {', '.join(points)}")
    for seed in [] if args.table else [int(s) for s in args.seeds.split(",")]:
        for name in names:
            if str(seed) in result["runs"].get(name, {}):
                continue  # measured before: the grid runs in parts
            print(f"[ablation] {name} seed {seed}: {args.versions} versions ...", flush=True)
            t0 = time.time()
            result["runs"].setdefault(name, {})[str(seed)] = run_point(name, points[name], seed, args)
            r = result["runs"][name][str(seed)]
            print(
                f"[ablation] {name} seed {seed}: held-out {r['acc_start']:.2f} -> {r['acc_final']:.2f}, "
                f"staleness {r['staleness_mean']:.2f}, {r['rl_wall_s']:.0f} s of RL ({time.time() - t0:.0f} s)",
                flush=True,
            )
            result["table"] = table(result["runs"])
            atomic_write_text(path, json.dumps(result, indent=1))
    result["table"] = table(result["runs"])
    atomic_write_text(path, json.dumps(result, indent=1))
    print_table(result["table"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
