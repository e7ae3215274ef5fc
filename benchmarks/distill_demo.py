"""On-policy distillation against RL alone on the CPU demo: how many versions each needs to reach RL alone's final
held-out accuracy, at equal versions and at equal wall time, over several seeds.

The student is the demo model after its warm start (every run builds it from the same initial weights); the
teacher is a Hugging Face folder given with --teacher, e.g. the demo trained 400 versions and exported (a teacher
further ahead taught more slowly: docs/algorithm.md):

    .venv/bin/areal-hpc run jobs/demo.yaml store.run_dir=/tmp/teacher trainer.versions=400 trainer.max_wall_s=0 \
        trainer.checkpoint_every=100 trainer.seed=100 data.seed=100 model.path=benchmarks/results/distill_demo/model
    .venv/bin/areal-hpc export /tmp/teacher/checkpoints/v00000400 /tmp/teacher_hf
    .venv/bin/python benchmarks/distill_demo.py --teacher /tmp/teacher_hf --seeds 0,1,2

Arms: `rl` (the demo as it is), `rl_lr` (RL alone at the distillation arms' learning rate, --lr), `rl_wide` (RL
alone sampling as the distillation-with-reward arm does: 2 answers to each of 128 prompts), `distill` (the teacher's
reverse KL alone, no task reward: one answer to each of 256 prompts, since no group of answers is compared) and
`distill_reward` (both: 2 answers to each of 128 prompts). Every arm samples 256 answers a version. The distillation
arms run with distill.estimator=full (the exact KL in the loss; --estimator sample for the sampled one, arms then
named without the _full suffix), keep groups that score alike (ppo.drop_uniform_groups=false: the teacher still
teaches on them), and with --demo-shape sample as the demo does (8 answers to each of 32 prompts). The JSON is
written after every run and runs already in it are kept: move it aside to measure again.
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


def arms(
    teacher: str, coef: float, lr: float, estimator: str = "sample", demo_shape: bool = False
) -> dict[str, list[str]]:
    """Arm name -> its overrides of the demo config. RL alone runs at the demo's learning rate and at the
    distillation arms' (`lr`), so each method is measured at a rate that suits it, and at the distillation with
    reward arm's shape (rl_wide). With an `estimator` other than sample the distillation arms are named with it
    (distill_full, ...), apart from the sampled estimator's. Every arm samples 256 answers per version."""
    # every group carries the teacher's signal, whatever its rewards: none is dropped as uniform
    distill = [f"distill.teacher={teacher}", f"distill.coef={coef}", f"distill.estimator={estimator}"]
    distill += [f"trainer.lr={lr}", "ppo.drop_uniform_groups=false"]
    # The teacher scores every token of every answer, so distilling alone needs no group of answers to compare:
    # one answer to each of 256 prompts, where 8 answers to each of 32 prompts mostly repeat one another's prefixes.
    # The task reward needs a group to compare within: 2 answers to each of 128 prompts.
    alone, pairs = ([], []) if demo_shape else (SHAPES["one"], SHAPES["pairs"])
    tag = _tag(estimator)
    return {
        "rl": [],
        "rl_lr": [f"trainer.lr={lr}"],
        "rl_wide": SHAPES["pairs"],
        f"distill{tag}": [*distill, "distill.task_reward=false", *alone],
        f"distill_reward{tag}": [*distill, *pairs],
    }


# answers per prompt x prompts per version (256 answers, as the demo's 8 x 32), with as many groups per generator in
# flight as fill the demo's 128 sequences per engine
SHAPES = {
    "one": ["rollout.n_samples=1", "rollout.batch_prompts=256", "rollout.max_concurrent_groups=128"],
    "pairs": ["rollout.n_samples=2", "rollout.batch_prompts=128", "rollout.max_concurrent_groups=64"],
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


def _save(result: dict, path: Path) -> None:
    """The runs and, against each RL arm's final accuracy, the table, written atomically."""
    from areal_hpc.utils import atomic_write_text

    result["table"] = {ref: table(result["runs"], ref) for ref in result["runs"] if ref.startswith("rl")}
    atomic_write_text(path, json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True, help="the teacher's Hugging Face folder")
    ap.add_argument("--coef", type=float, default=1.0, help="distill.coef")
    ap.add_argument("--lr", type=float, default=3e-4, help="trainer.lr of the distillation arms and of rl_lr")
    ap.add_argument(
        "--arms",
        default="rl,rl_lr,rl_wide,distill,distill_reward",
        help="of rl, rl_lr, rl_wide, distill, distill_reward",
    )
    ap.add_argument("--estimator", default="full", choices=("sample", "full"), help="distill.estimator")
    ap.add_argument(
        "--demo-shape", action="store_true", help="distillation arms sample as the demo does: 8 answers x 32 prompts"
    )
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
    result.update(demo_shape=args.demo_shape)
    grid = arms(args.teacher, args.coef, args.lr, args.estimator, args.demo_shape)
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
            _save(result, path)
    _save(result, path)  # the tables, also when every run was measured before
    for ref, rows in result["table"].items():
        print(f"against {ref}'s final accuracy:")
        for row in rows:
            print(json.dumps(row))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
