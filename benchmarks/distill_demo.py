"""On-policy distillation against RL alone on the CPU demo: how many versions each needs to reach RL alone's final
held-out accuracy, at equal versions and at equal wall time, over several seeds.

The student is the demo model after its warm start (every run builds it from the same initial weights); the
teacher is a Hugging Face folder given with --teacher, e.g. the demo trained 400 versions and exported (a teacher
further ahead taught more slowly: docs/algorithm.md):

    .venv/bin/areal-hpc run jobs/demo.yaml store.run_dir=/tmp/teacher trainer.versions=400 trainer.max_wall_s=0 \
        trainer.checkpoint_every=100 trainer.seed=100 data.seed=100 model.path=benchmarks/results/distill_demo/model
    .venv/bin/areal-hpc export /tmp/teacher/checkpoints/v00000400 /tmp/teacher_hf
    .venv/bin/python benchmarks/distill_demo.py --teacher /tmp/teacher_hf --seeds 0,1,2

Arms: `rl` (the demo as it is), `rl_lr` (RL alone at the distillation arms' learning rate), `distill` (the
teacher's reverse KL alone, no task reward) and `distill_reward` (both). `--estimator full` runs the distillation
arms with distill.estimator=full (the exact KL in the loss), named distill_full and distill_reward_full. Both
distillation arms keep groups that score alike (ppo.drop_uniform_groups=false): the teacher still teaches on them.
The JSON is written after every run and runs already in it are kept.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from staleness_ablation import run_point  # benchmarks/ is on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def arms(teacher: str, coef: float, lr: float, estimator: str = "sample") -> dict[str, list[str]]:
    """Arm name -> its overrides of the demo config. RL alone runs at the demo's learning rate and at the
    distillation arms' (`lr`), so each method is measured at a rate that suits it. With an `estimator` other than
    sample the distillation arms are named with it (distill_full, ...), apart from the sampled estimator's."""
    # every group carries the teacher's signal, whatever its rewards: none is dropped as uniform
    distill = [f"distill.teacher={teacher}", f"distill.coef={coef}", f"distill.estimator={estimator}"]
    distill += [f"trainer.lr={lr}", "ppo.drop_uniform_groups=false"]
    tag = _tag(estimator)
    return {
        "rl": [],
        "rl_lr": [f"trainer.lr={lr}"],
        f"distill{tag}": [*distill, "distill.task_reward=false"],
        f"distill_reward{tag}": distill,
    }


def _tag(estimator: str) -> str:
    return "" if estimator == "sample" else f"_{estimator}"


def _first_reaching(curve: dict, target: float) -> tuple[float, float]:
    """(version, wall seconds) of the first evaluation at or above `target`; nan where none does."""
    for v, wall, acc in zip(curve["version"], curve["wall_s"], curve["heldout_acc"], strict=True):
        if acc >= target - 1e-9:
            return v, wall
    return math.nan, math.nan


def _acc_within(curve: dict, wall_s: float) -> float:
    """The last held-out accuracy measured within `wall_s` seconds of the run (equal wall time)."""
    accs = [a for w, a in zip(curve["wall_s"], curve["heldout_acc"], strict=True) if w <= wall_s + 1e-9]
    return accs[-1] if accs else math.nan


def table(runs: dict, ref: str = "rl") -> list[dict]:
    """Per arm: final accuracy, the versions to the final accuracy of RL alone (arm `ref`) of the same seed, and
    the accuracy at that run's wall time."""
    rl = runs.get(ref, {})
    rows = []
    for arm, seeds in runs.items():
        reach, acc_eq_wall, ratios = [], [], []
        for s, r in seeds.items():
            if s not in rl:
                continue
            v, _ = _first_reaching(r["curve"], rl[s]["acc_final"])
            reach.append(v)
            ratios.append(v / rl[s]["versions"])
            acc_eq_wall.append(_acc_within(r["curve"], rl[s]["curve"]["wall_s"][-1]))
        rows.append(
            {
                "arm": arm,
                "seeds": len(seeds),
                "acc_final": [seeds[s]["acc_final"] for s in sorted(seeds)],
                "acc_final_mean": statistics.fmean(r["acc_final"] for r in seeds.values()),
                "versions_to_rl_final": reach,
                "share_of_rl_versions": ratios,
                "acc_at_rl_wall": acc_eq_wall,
                "rl_wall_s": statistics.fmean(r["rl_wall_s"] for r in seeds.values()),
            }
        )
    return rows


def main() -> None:
    from areal_hpc.utils import atomic_write_text

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True, help="the teacher's Hugging Face folder")
    ap.add_argument("--coef", type=float, default=1.0, help="distill.coef")
    ap.add_argument("--lr", type=float, default=1e-4, help="trainer.lr of the distillation arms and of rl_lr")
    ap.add_argument("--arms", default="rl,distill,distill_reward", help="of rl, rl_lr, distill, distill_reward")
    ap.add_argument("--estimator", default="sample", choices=("sample", "full"), help="distill.estimator")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--versions", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", type=Path, default=RESULTS / "distill_demo")
    args = ap.parse_args()
    args.setting = "demo"  # run_point's settings: the demo's own
    args.out.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "distill_demo.json"
    result = json.loads(path.read_text()) if path.is_file() else {"benchmark": "distill_demo", "runs": {}}
    result.update(versions=args.versions, eval_every=args.eval_every, teacher=args.teacher, coef=args.coef, lr=args.lr)
    grid = arms(args.teacher, args.coef, args.lr, args.estimator)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in [a if a.startswith("rl") else a + _tag(args.estimator) for a in args.arms.split(",")]:
            if str(seed) in result["runs"].get(arm, {}):
                continue  # measured before
            t0 = time.time()
            r = run_point(arm, grid[arm], seed, args)
            result["runs"].setdefault(arm, {})[str(seed)] = r
            print(
                f"[distill] {arm} seed {seed}: held-out {r['acc_start']:.2f} -> {r['acc_final']:.2f}, "
                f"{r['rl_wall_s']:.0f} s of RL ({time.time() - t0:.0f} s)",
                flush=True,
            )
            result["table"] = {ref: table(result["runs"], ref) for ref in ("rl", "rl_lr")}
            atomic_write_text(path, json.dumps(result, indent=1))
    result["table"] = {ref: table(result["runs"], ref) for ref in ("rl", "rl_lr")}
    atomic_write_text(path, json.dumps(result, indent=1))
    for ref, rows in result["table"].items():
        print(f"against {ref}'s final accuracy:")
        for row in rows:
            print(json.dumps(row))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
