"""The workflow layer's cost and the tool's: streaming through episodes against the code before them, and tool
calls that wait off the engine against a tool that holds the generator's loop.

1. No regression (--baseline REF, default the commit before the workflow layer): the streaming workload of
   benchmarks/streaming.py (1 generator + 1 trainer, pinned roles, torch engine, 4 slots, long-tailed
   answers) at eta=4, single_turn, run by this checkout and by REF checked out in a temporary worktree,
   interleaved (base, new, base, new, ...): consumed tokens/s, new over base per pair and overall.
2. Tools (--tools): a workflow that answers, calls a tool taking --tool-ms, appends one token and answers
   again. `async_tool` awaits the tool (asyncio.sleep: other episodes keep the engine full);
   `blocking_tool` calls time.sleep inside the episode, so the generator's whole loop waits, as a step loop
   that ran tools inline would. Engine occupancy outside the first and last version, side by side.

    .venv/bin/python benchmarks/workflows.py                     # both parts, about 15 minutes on 2 cores
    .venv/bin/python benchmarks/workflows.py --pairs 3 --no-tools
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _runs import BASE_WORKLOAD, figures  # benchmarks/ is on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BEFORE_WORKFLOWS = "a9c0fd7"  # main before the workflow layer (issue 25)
WORKLOAD = [*BASE_WORKLOAD, "logging.eval_prompts=4", "cluster.pin_roles=true", "rollout.engine=torch"]
TOOLS = ROOT / "benchmarks" / "_tool_workflows.py"

# one run, in whichever checkout is the working directory: that tree's areal_hpc runs every rank
_ONE_RUN = """
import json, shutil, sys
from pathlib import Path
from areal_hpc.config import load_config
from areal_hpc.launch.local import launch
run_dir, model, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
shutil.rmtree(run_dir, ignore_errors=True)
cfg = load_config("jobs/demo.yaml", [*overrides, f"store.run_dir={run_dir}", f"model.path={model}"])
import areal_hpc
print("AREAL_HPC_FROM", Path(areal_hpc.__file__).parent, flush=True)
print("SUMMARY", json.dumps(launch(cfg, progress=False)), flush=True)
"""


def run_in(tree: Path, run_dir: Path, model: Path, overrides: list[str]) -> dict:
    """A run of jobs/demo.yaml + overrides with `tree`'s code; its summary and the streaming figures."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", _ONE_RUN, str(run_dir), str(model), *overrides]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if " " in ln}
    if p.returncode != 0 or "SUMMARY" not in lines:
        raise RuntimeError(f"run in {tree} failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    if Path(lines["AREAL_HPC_FROM"]) != tree / "areal_hpc":
        raise RuntimeError(f"the run in {tree} imported areal_hpc from {lines['AREAL_HPC_FROM']}")
    s = json.loads(lines["SUMMARY"])
    return {"consumed_tokens_per_s": s["consumed_tokens_per_s"], "rl_wall_s": s["rl_wall_s"], **figures(run_dir, s)}


def no_regression(args, out: Path) -> dict:
    base = Path(tempfile.mkdtemp(prefix="areal-base-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline], cwd=ROOT, check=True)
    overrides = [
        *WORKLOAD,
        "rollout.eta=4",
        "rollout.weight_update=keep_kv",
        f"rollout.max_new_tokens={args.max_new}",
        f"rollout.max_num_seqs={args.slots}",
        f"trainer.versions={args.versions}",
    ]
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    try:
        for i in range(args.pairs):
            for name, tree in (("base", base), ("new", ROOT)):
                print(f"[bench] no-regression pair {i + 1}/{args.pairs}: {name} ...", flush=True)
                runs[name].append(run_in(tree, out / f"{name}-{i}", out / "model", overrides))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    tps = {k: [r["consumed_tokens_per_s"] for r in v] for k, v in runs.items()}
    return {
        "baseline": args.baseline,
        "runs": runs,
        "pair_ratios": [n / b for n, b in zip(tps["new"], tps["base"])],
        "new_over_base": sum(tps["new"]) / sum(tps["base"]),
    }


def tools(args, out: Path) -> dict:
    res = {}
    for name in ("async_tool", "blocking_tool"):
        print(f"[bench] tools: {name} ({args.tool_ms} ms per call) ...", flush=True)
        overrides = [
            *WORKLOAD,
            "rollout.eta=4",
            f"workflow.fn={TOOLS}:{name}",
            f"workflow.args={{tool_s: {args.tool_ms / 1000}}}",
            f"rollout.max_new_tokens={args.max_new // 2}",
            f"rollout.max_num_seqs={args.slots}",
            f"trainer.versions={args.versions}",
        ]
        res[name] = run_in(ROOT, out / name, out / "model", overrides)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=BEFORE_WORKFLOWS, help="the git commit to compare against")
    ap.add_argument("--pairs", type=int, default=2, help="interleaved (baseline, this checkout) runs")
    ap.add_argument("--versions", type=int, default=15)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tool-ms", type=float, default=200.0)
    ap.add_argument("--no-regression", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tools", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", type=Path, default=RESULTS / "workflows")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "workflows", "host": platform.node(), "time": time.time(), "args": vars(args) | {}}
    result["args"]["out"] = str(args.out)
    if args.no_regression:
        nr = result["no_regression"] = no_regression(args, args.out)
        print(f"\n{'run':<8}{'consumed tok/s':>16}{'occupancy':>12}{'step_share':>12}{'rows/step':>11}")
        for name, rs in nr["runs"].items():
            for r in rs:
                print(
                    f"{name:<8}{r['consumed_tokens_per_s']:>16.0f}{r['occupancy']:>12.3f}{r['step_share']:>12.3f}"
                    f"{r['rows_per_step_mean']:>11.1f}"
                )
        pairs = ", ".join(f"{x:.3f}" for x in nr["pair_ratios"])
        print(f"this checkout / {args.baseline}: {nr['new_over_base']:.3f} (pairs: {pairs})\n")
    if args.tools:
        tr = result["tools"] = tools(args, args.out)
        print(f"{'variant':<15}{'occupancy':>12}{'consumed tok/s':>16}{'generator busy':>16}{'step_share':>12}")
        for name, r in tr.items():
            print(
                f"{name:<15}{r['occupancy']:>12.3f}{r['consumed_tokens_per_s']:>16.0f}{r['generator_busy']:>16.3f}"
                f"{r['step_share']:>12.3f}"
            )
    from areal_hpc.utils import atomic_write_text

    atomic_write_text(args.out / "workflows.json", json.dumps(result, indent=1))
    print(f"wrote {args.out / 'workflows.json'}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
