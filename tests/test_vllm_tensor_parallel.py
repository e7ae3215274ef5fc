"""A tensor-parallel vLLM generator (two worker processes) runs the demo as a Slurm job whose first world stalls
inside a weight update and is restarted, losing and doubling nothing, with vLLM's version on every token
(docs/cluster.md). How much the demo learns at TP 2 (through `areal-hpc run` and as a Slurm job, 200 versions each)
is measured, not tested: each such run takes 5-10 minutes of the suite's 60 (docs/measurements.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from areal_hpc.launch.restarts import load_restarts
from areal_hpc.launch.slurm import wait_for
from areal_hpc.store import Ledger, load_trajectories

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "areal_hpc.cli"]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
# a checkpoint at version 4, the stall in version 6's update, the restarted world resumes at 4 and ends at 12
VERSIONS, ETA, B, N = 12, 2, 8, 8


def _overrides(tmp_path: Path, *more: str) -> list[str]:
    return [
        f"store.run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        "rollout.engine=vllm",
        "cluster.devices_per_generator=2",
        "cluster.n_generators=1",
        f"trainer.versions={VERSIONS}",
        f"rollout.batch_prompts={B}",
        "trainer.max_wall_s=0",  # versions, not seconds: a busy machine must not cut the run short
        "logging.eval_every=0",  # the first and the last
        "logging.eval_prompts=16",  # what this test asks of them is that they run
        "logging.trackers=[]",
        *more,
    ]


def _audited(run: Path) -> dict:
    """The summary, once the store's exactly-once audit and vLLM's per-token versions are checked."""
    s = json.loads((run / "summary.json").read_text())
    ledger = Ledger(run)  # raises on a trajectory consumed twice
    eaten = load_trajectories(run).query("consumed_version >= 0")
    assert len(eaten) == len(ledger.consumed()) == VERSIONS * B * N  # every version a full batch, none lost
    assert (eaten["staleness"] <= ETA).all()
    # every token's version is vLLM's own stamp, and none differed from the version loaded when it was sampled
    assert s["engine_versions_checked"] > 0 and s["engine_versions_mismatched"] == 0, s
    m = pd.read_csv(run / "metrics.csv")
    assert m["weights_match"].dropna().eq(1).all() and m["weights_match"].notna().sum() >= VERSIONS - 4
    return s


@pytest.mark.slow
def test_a_tensor_parallel_slurm_job_recovers_from_a_stalled_weight_update(tmp_path):
    started = subprocess.run(["bash", str(ROOT / "env" / "slurm-up.sh")], capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, started.stdout + started.stderr
    r = subprocess.run(
        [*CLI, "render", str(ROOT / "jobs" / "demo.yaml")]
        + _overrides(tmp_path, "trainer.checkpoint_every=4", "sync.limit_s=10", "slurm.max_restarts=2"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(r.stdout)
    env = {**os.environ, "AREAL_HPC_FAULT": "stall-update@6"}  # the first world's workers stall in version 6's load
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, env=env)
    job_id = job.stdout.strip()
    try:
        assert wait_for(job_id, DONE, 1800) == "COMPLETED", sorted((tmp_path / "run" / "logs").iterdir())
    except BaseException:
        subprocess.run(["scancel", job_id], check=False)  # a failed test leaves no job on the shared cluster
        raise
    run = tmp_path / "run"
    (restart,) = load_restarts(run)  # one restart: the stall, named by trainer 0's send limit
    assert restart["restarted"] and "weight sync: send of version 6" in restart["cause"], restart
    s = _audited(run)
    assert s["start_version"] == 4 and s["versions"] == VERSIONS  # resumed from the checkpoint before the stall
