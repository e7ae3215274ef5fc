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
    "logging.tensorboard=false",
    "logging.progress=false",
]
# the synchronous baseline and the asynchronous runtime with and without interruption, side by side
VARIANTS = {
    "eta0": ["rollout.eta=0", "rollout.interrupt=true"],
    "eta4": ["rollout.eta=4", "rollout.interrupt=true"],
    "eta4_no_interrupt": ["rollout.eta=4", "rollout.interrupt=false"],
}


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
