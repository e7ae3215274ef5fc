"""What the runtime benchmarks share: one local run of the demo config with overrides, from a fresh run dir."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# 1 generator + 1 trainer, every group trained on, no warm start, checkpoints or periodic evaluation
BASE_WORKLOAD = [
    "cluster.n_generators=1",
    "cluster.n_trainers=1",
    "cluster.threads_per_rank=1",
    "rollout.batch_prompts=16",
    "rollout.n_samples=8",
    "trainer.warm_start_steps=0",
    "trainer.lr=1e-5",
    "ppo.drop_uniform_groups=false",
    "trainer.max_wall_s=0",
    "trainer.checkpoint_every=0",
    "logging.eval_every=0",
    "logging.trackers=[]",
    "logging.progress=false",
]
WEIGHT_UPDATES = ("keep_kv", "recompute", "drain")  # rollout.weight_update
# the synchronous baseline and the asynchronous runtime under each weight-update mode, side by side
VARIANTS = {
    "eta0": ["rollout.eta=0", "rollout.weight_update=keep_kv"],
    **{f"eta4_{m}": ["rollout.eta=4", f"rollout.weight_update={m}"] for m in WEIGHT_UPDATES},
}


def overlap(starts, ends, lo: float, hi: float) -> float:
    """Total length of the spans [start, end] inside [lo, hi]."""
    import numpy as np

    return float(np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None).sum())


def figures(run_dir: Path, summary: dict) -> dict:
    """Busy shares over the RL wall time, occupancy outside the first and last version, the engine's steps."""
    import pandas as pd

    from areal_hpc.rundir import RunDir
    from areal_hpc.runtime.comm.timeline import load_engine_samples, load_timeline

    tl = load_timeline(run_dir)
    # metrics.csv's clock origin (rank 0 starts it after loading the dataset, seconds after its timeline starts)
    t0 = summary["t0"]
    m = pd.read_csv(RunDir(run_dir).metrics).set_index("version")
    rl_lo, rl_hi = t0 + m.loc[0, "wall_s"], t0 + m["wall_s"].iloc[-1]  # first weights published -> last version trained
    out = {}
    for role, event in (("generator", "generate"), ("trainer", "train")):
        spans = tl[(tl.role == role) & (tl.event == event)]
        out[f"{role}_busy"] = overlap(spans.t_start.to_numpy(), spans.t_end.to_numpy(), rl_lo, rl_hi) / (rl_hi - rl_lo)
    versions = m.index.max()
    lo, hi = t0 + m.loc[1, "wall_s"], t0 + m.loc[versions - 1, "wall_s"]  # outside the first and last version
    eng = load_engine_samples(run_dir)
    inside = overlap(eng.t_start.to_numpy(), eng.t_end.to_numpy(), lo, hi)
    frac = ((eng.t_end.clip(upper=hi) - eng.t_start.clip(lower=lo)).clip(lower=0) / (eng.t_end - eng.t_start)).fillna(0)
    out["occupancy"] = float((eng.seq_s * frac).sum() / (eng.capacity.iloc[0] * (hi - lo)))
    out["occupancy_window_covered"] = inside / (hi - lo)
    gen_spans = tl[(tl.role == "generator") & (tl.event == "generate")]
    out["generating_s"] = float(gen_spans["duration"].sum())
    # the loop's own cost, free of the host's drift (shares within one run): generating time spent inside
    # engine steps (the rest is the loop between them), and the share of a core the steps got
    out["step_share"] = float(eng.step_s.sum()) / out["generating_s"]
    out["step_cpu_share"] = float(eng.cpu_s.sum() / eng.step_s.sum())
    out["step_ms_mean"] = 1e3 * float(eng.step_s.sum() / eng.steps.sum())
    out["rows_per_step_mean"] = float(eng.seq_steps.sum() / eng.steps.sum())
    out["sampled_tokens"] = int(eng.seq_steps.sum())
    out["group_wall_s_mean"] = float(tl[(tl.role == "generator") & (tl.event == "group")]["duration"].mean())
    out["prefill_tokens_per_version"] = summary.get("prefill_tokens", 0) / max(summary["versions"], 1)
    return out


def launch_run(run_dir: Path, overrides: list[str], model_dir: Path):
    """(config, summary) of `jobs/demo.yaml` + overrides run under mpirun in `run_dir` (emptied first).

    Every run of one benchmark shares `model_dir`: the tiny model is built once, so all start equal.
    """
    from areal_hpc.config import load_config
    from areal_hpc.launch.local import launch

    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(
        ROOT / "jobs" / "demo.yaml",
        [*overrides, f"store.run_dir={run_dir}", f"model.path={model_dir}", f"run_name=bench_{run_dir.name}"],
    )
    return cfg, launch(cfg, progress=False)
