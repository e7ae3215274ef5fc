"""The tool demo beside the same task without the tool: jobs/demo_tool.yaml under `tool` and `single_turn`, same
warm start steps, RL budget and seeds. Held-out accuracy and the share of held-out answers calling the tool,
after the warm start and at the end; turns and tool calls per episode.

    .venv/bin/python benchmarks/tool_demo.py                 # 2 seeds x 2 workflows, about 12 minutes
    .venv/bin/python benchmarks/tool_demo.py --seeds 1 --max-wall 60
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from areal_hpc.config import load_config  # noqa: E402 (after the path: runs from a checkout)
from areal_hpc.launch.local import launch  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def one_run(workflow: str, seed: int, args) -> dict:
    import pandas as pd

    run_dir = args.out / f"{workflow}-s{seed}"
    cfg = load_config(
        ROOT / "jobs" / "demo_tool.yaml",
        [
            f"workflow.fn={workflow}",
            f"trainer.seed={seed}",
            f"data.seed={seed}",
            f"trainer.max_wall_s={args.max_wall}",
            f"store.run_dir={run_dir}",
            f"model.path={args.out / 'model'}",
            f"run_name=tool_demo_{workflow}_s{seed}",
            "logging.progress=false",
        ],
    )
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    s = launch(cfg, progress=False)
    m = pd.read_csv(run_dir / "metrics.csv")
    return {
        "acc_start": s["acc_start"],
        "acc_final": s["acc_final"],
        "tool_share_start": s["tool_share_start"],
        "tool_share_final": s["tool_share_final"],
        "versions": s["versions"],
        "rl_wall_s": s["rl_wall_s"],
        "turns_mean": float(m["turns_mean"].mean()),
        "tool_calls_per_episode": float(m["tool_calls"].sum() / m["samples"].sum()),
        "tool_errors": int(m["tool_errors"].sum()),
        "trained_share": float(m["trained_share"].mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--max-wall", type=float, default=150.0, help="seconds of RL per run (trainer.max_wall_s)")
    ap.add_argument("--out", type=Path, default=RESULTS / "tool_demo")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "tool_demo", "host": platform.node(), "time": time.time(), "runs": {}}
    keys = ("acc_start", "acc_final", "tool_share_start", "tool_share_final", "versions", "turns_mean")
    for seed in range(1, args.seeds + 1):
        for workflow in ("tool", "single_turn"):
            print(f"[bench] {workflow} seed {seed} ...", flush=True)
            result["runs"][f"{workflow}-s{seed}"] = one_run(workflow, seed, args)
    print(f"\n{'run':<18}" + "".join(f"{k:>18}" for k in (*keys, "tool_calls/ep")))
    for name, r in result["runs"].items():
        print(f"{name:<18}" + "".join(f"{r[k]:>18.3f}" for k in keys) + f"{r['tool_calls_per_episode']:>18.3f}")
    from areal_hpc.utils import atomic_write_text

    atomic_write_text(args.out / "tool_demo.json", json.dumps(result, indent=1))
    print(f"wrote {args.out / 'tool_demo.json'}")


if __name__ == "__main__":
    main()
