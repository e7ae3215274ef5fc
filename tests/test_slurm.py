"""Slurm end to end, on the real local cluster env/slurm-up.sh starts (4 virtual nodes, accounting on)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_hpc.config import load_config
from areal_hpc.launch.slurm import SlurmError, check_request, job_state, wait_for
from areal_hpc.rundir import RunDir
from areal_hpc.store import Ledger, load_trajectories

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"
CLI = [sys.executable, "-m", "areal_hpc.cli"]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    """The cluster is started by env/ (idempotent: a second start only checks it is up)."""
    r = subprocess.run(["bash", str(ROOT / "env" / "slurm-up.sh")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


B = 16  # prompts per version: half the demo's, every batch B informative groups (the tests are about Slurm)


def _args(tmp_path, *more):
    return [
        f"store.run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        "logging.eval_prompts=20",
        "logging.trackers=[]",
        "trainer.max_wall_s=0",
        f"rollout.batch_prompts={B}",
        *more,
    ]


def _audit(run: Path, eta: int, versions: int) -> None:
    ledger = Ledger(run)  # raises on a trajectory consumed twice
    df = load_trajectories(run)
    eaten = df[df["consumed_version"] >= 0]
    assert df.attrs["unmatched_ledger_entries"] == 0
    assert len(eaten) == len(ledger.consumed()) == versions * B * 8
    assert (eaten["staleness"] <= eta).all() and (eaten["version_end"] <= eaten["consumed_version"]).all()


def _cli(*args, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def _sbatch(tmp_path, *overrides) -> str:
    """Render the demo job with these overrides and submit it with plain sbatch; returns the job id."""
    r = _cli("render", str(DEMO), *_args(tmp_path, *overrides))
    assert r.returncode == 0, r.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(r.stdout)
    return subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True
    ).stdout.strip()


def _progress(run: Path, since: float = 0.0) -> int:
    """The version progress.json says, if it was written after `since` (by a world started since); else -1."""
    p = RunDir(run).read_progress()
    return p["version"] if p is not None and p["time"] > since else -1


def _world_starts(run: Path) -> int:
    """How many MPI worlds the job script has started so far (its job output, appended across requeues)."""
    return sum(p.read_text().count(" starting on ") for p in (run / "logs").glob("slurm-*.out"))


def _start_requeued(run: Path, job_id: str, starts: int, timeout: float = 150) -> None:
    """Slurm holds a requeued job for 2 minutes before it is eligible again: start it now, and ask again
    until a new world starts (an update sent while the job is still leaving RUNNING may not take)."""
    end = time.time() + timeout
    while _world_starts(run) <= starts and time.time() < end:
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"], check=False, capture_output=True)


def _wait_version(run: Path, version: int, job_id: str, timeout: float = 180, since: float = 0.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if _progress(run, since) >= version:
            return
        assert job_state(job_id) not in DONE, job_state(job_id)
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not reach version {version}")


def test_rendered_sbatch_runs_with_plain_sbatch(tmp_path):
    # rendered in one directory with relative paths, submitted from another: the script carries absolute ones
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir(), there.mkdir()
    rows = [{"question": f"{x}+{y}=", "answer": str(x + y)} for x in range(20) for y in range(20)]
    (here / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    relative = ["store.run_dir=../run", "model.path=../model", "data.kind=jsonl", "data.path=sums.jsonl"]
    r = subprocess.run(
        [*CLI, "render", str(DEMO), *_args(tmp_path, "trainer.versions=8")[2:], *relative],
        cwd=here,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    script = there / "job.sbatch"
    script.write_text(r.stdout)
    assert "#SBATCH hetjob" in r.stdout and "srun --mpi=pmix" in r.stdout
    assert f"path: {here / 'sums.jsonl'}" in r.stdout and f"path: {tmp_path / 'model'}" in r.stdout
    test_only = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, cwd=there)
    assert test_only.returncode == 0 and "to start" in test_only.stderr, test_only.stderr
    t0 = time.time()
    job_id = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, cwd=there
    ).stdout.strip()
    run = tmp_path / "run"
    first_batch = None
    while job_state(job_id) not in DONE and time.time() - t0 < 240:
        if first_batch is None and (run / "ledger" / "v00000000.json").exists():
            first_batch = time.time() - t0
        time.sleep(0.2)
    assert job_state(job_id) == "COMPLETED", (run / "logs").iterdir()
    print(f"\n[slurm] sbatch -> first consumed batch {first_batch:.1f} s, -> COMPLETED {time.time() - t0:.1f} s")
    _audit(run, eta=2, versions=8)
    assert len(list((run / "logs").glob("rank*-*.log"))) == 4 and list((run / "logs").glob("slurm-*.out"))
    status = _cli("status", str(run))
    assert status.returncode == 0 and "COMPLETED" in status.stdout and "version 8/8" in status.stdout


def test_submitit_submit_status_and_completion(tmp_path):
    r = _cli("submit", str(DEMO), *_args(tmp_path, "trainer.versions=6", "rollout.eta=1"))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[2]
    run = tmp_path / "run"
    assert wait_for(job_id, DONE, 240) == "COMPLETED"
    status = _cli("status", str(run))
    assert f"job {job_id}: COMPLETED" in status.stdout and "version 6/6" in status.stdout
    _audit(run, eta=1, versions=6)
    assert any((run / "slurm" / "submitit").glob(f"{job_id}_*_log.out"))  # submitit's own folder and logs
    assert _cli("submit", str(DEMO), *_args(tmp_path)).returncode != 0  # the run dir is taken


def test_sweep_runs_as_a_job_array_and_collects(tmp_path):
    import areal_hpc

    jobs = areal_hpc.sweep(
        DEMO,
        {"rollout.eta": [0, 2]},
        tmp_path / "sweep",
        overrides=[
            f"model.path={tmp_path / 'model'}",
            "trainer.versions=4",
            "logging.eval_prompts=20",
            "logging.trackers=[]",
        ],
    )
    assert len({j.job_id.split("_")[0] for j in jobs}) == 1  # one array
    for j in jobs:
        assert wait_for(j.job_id, DONE, 300) == "COMPLETED"
    df = areal_hpc.collect(tmp_path / "sweep")
    assert list(df["rollout.eta"]) == [0, 2] and (df["status"] == "COMPLETED").all()
    assert (df["versions"] == 4).all() and df["consumed_tokens_per_s"].gt(0).all() and df["acc_final"].notna().all()
    for job_id, run_dir in zip(df["job_id"], df["run_dir"]):  # each point as JOBID_TASK, also once it has run
        assert job_id.split("_")[1].isdigit() and f"job {job_id}: COMPLETED" in _cli("status", run_dir).stdout


def test_requeue_twice_mid_run_resumes_from_checkpoint_each_time(tmp_path):
    job_id = _sbatch(tmp_path, "trainer.versions=16", "trainer.checkpoint_every=4")
    run = tmp_path / "run"
    for at in (6, 11):
        _wait_version(run, at, job_id)
        t_requeue, v_requeue, starts = time.time(), _progress(run), _world_starts(run)
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        _start_requeued(run, job_id, starts)
        # the new start runs: status never shows the stopped start's progress (its "(finished)") as this one's
        out = _cli("status", str(run))
        assert out.returncode == 0 and "(finished)" not in out.stdout and "(stopped)" not in out.stdout, out.stdout
        _wait_version(run, v_requeue + 1, job_id, since=time.time())  # progress of the new world only
        print(f"\n[chaos] scontrol requeue at v{v_requeue}: past it again {time.time() - t_requeue:.1f} s later")
    assert wait_for(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 300) == "COMPLETED"
    s = json.loads((run / "summary.json").read_text())
    assert s["start_version"] >= 8 and s["versions"] == 16  # the third start resumed, it did not start over
    out = next((run / "logs").glob("slurm-*.out")).read_text()
    assert "requeue count 2" in out and out.count("resuming") >= 2
    _audit(run, eta=2, versions=16)
    assert RunDir(run).latest_checkpoint() == 16


def test_requests_the_cluster_cannot_serve_are_refused_in_one_line(tmp_path, monkeypatch):
    def refused(*overrides):
        r = _cli("render", str(DEMO), *_args(tmp_path), *overrides)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        return r.stderr

    assert "partition 'debug' has 4" in refused("slurm.train_nodes=3", "slurm.gen_nodes=2")
    assert "does not exist; partitions here: debug" in refused("slurm.partition=gpu-h100")
    assert "GPUs" in refused("slurm.gpus_per_node=8")
    assert "CPUs" in refused("cluster.n_generators=9", "slurm.gen_nodes=1", "slurm.cpus_per_task=1")
    assert "model" in refused("model.build_tiny=false", f"model.path={tmp_path / 'no-model'}")
    # sizing: more GPU ranks than GPUs on a node, and a time-limit signal shorter than a version + checkpoint
    recipe = [str(ROOT / "jobs" / "math_1p5b_gpu.yaml"), f"model.path={tmp_path}", f"data.path={tmp_path / 'd.jsonl'}"]
    for more, words in (
        (["cluster.n_trainers=9", "slurm.signal_s=3600"], "cluster.n_trainers=9 on slurm.train_nodes=1 puts 9 GPU"),
        (["slurm.signal_s=60"], "slurm.signal_s=60 is shorter than one version plus a checkpoint"),
    ):
        r = _cli("render", "--no-check", *recipe, f"store.run_dir={tmp_path / 'gpu'}", *more)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr
    assert _cli("render", "--no-check", *recipe, f"store.run_dir={tmp_path / 'gpu'}").returncode == 0
    # a multi-node job on nodes elsewhere needs the run dir on a shared filesystem
    import areal_hpc.launch.slurm as slurm

    real = slurm.partition_info
    monkeypatch.setattr(
        slurm, "partition_info", lambda p="": slurm.PartitionInfo(**{**real(p).__dict__, "hosts": {"node-a", "node-b"}})
    )
    cfg = load_config(DEMO, _args(tmp_path))
    assert slurm._fs_type(tmp_path) not in slurm.SHARED_FS  # this machine's /tmp is local
    with pytest.raises(SlurmError, match="local filesystem .* must be on a shared one"):
        check_request(cfg)
    monkeypatch.setattr(slurm, "_fs_type", lambda path: "lustre")
    check_request(cfg)


def test_time_limit_signal_checkpoints_stops_and_requeues(tmp_path):
    # what Slurm sends slurm.signal_s before the time limit: USR1 to the batch shell
    job_id = _sbatch(tmp_path, "trainer.versions=20", "trainer.checkpoint_every=100")
    run = tmp_path / "run"
    _wait_version(run, 6, job_id)
    t_signal = time.time()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    end = time.time() + 120
    while (
        "requeueing job" not in "".join(p.read_text() for p in (run / "logs").glob("slurm-*.out")) and time.time() < end
    ):
        time.sleep(0.5)
    t_stopped = time.time()
    stopped_at = json.loads((run / "summary.json").read_text())["versions"]
    assert RunDir(run).latest_checkpoint() == stopped_at >= 6  # a clean stop checkpoints where it stopped
    _start_requeued(run, job_id, _world_starts(run))  # until a world starts after the stopped one
    _wait_version(run, stopped_at + 1, job_id, since=t_stopped)
    print(
        f"\n[chaos] USR1 at v{stopped_at}: checkpointed and requeued {t_stopped - t_signal:.1f} s later,"
        f" past v{stopped_at} again {time.time() - t_signal:.1f} s after the signal"
    )
    assert wait_for(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 300) == "COMPLETED"
    s = json.loads((run / "summary.json").read_text())
    assert s["start_version"] == stopped_at and s["versions"] == 20  # resumed exactly where it stopped
    _audit(run, eta=2, versions=20)


def _files(run: Path) -> dict[str, int]:
    """Every file's mtime but the cancelled job's own stdout and stderr: Slurm reads CANCELLED as soon as
    scancel is sent, and slurmstepd may still append its kill notice to them (seen on CI 4.7 s later)."""
    ours = (p for p in run.rglob("*") if p.is_file() and not (p.parent.name == "submitit" and "_log." in p.name))
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for p in ours}


def test_cancel_then_resume_with_more_versions_pending_first(tmp_path):
    r = _cli("submit", str(DEMO), *_args(tmp_path, "trainer.versions=100000"))
    job_id = r.stdout.split()[2]
    run = tmp_path / "run"
    _wait_version(run, 1, job_id)
    c = _cli("cancel", str(run))
    assert c.returncode == 0 and f"cancelled job {job_id}" in c.stdout
    assert wait_for(job_id, DONE, 60) == "CANCELLED"
    assert f"job {job_id}: CANCELLED" in _cli("status", str(run)).stdout
    assert "not submitted" in _cli("status", str(tmp_path)).stderr
    stopped = RunDir(run).latest_checkpoint()  # scancel's TERM: rank 0 checkpoints where it stops
    assert stopped is not None and stopped >= 1

    # what would break the run is refused in one line, and the run directory stays as it was
    before = _files(run)
    for bad, words in (
        ("rollout.eta=4", "rollout.eta cannot change when a run resumes"),
        ("rollout.n_samples=4", "rollout.n_samples cannot change"),
        ("model.arch=qwen2", "model.arch cannot change"),
        (f"trainer.versions={stopped}", "nothing left to train"),
    ):
        out = _cli("resume", str(run), bad)
        assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1 and words in out.stderr, out.stderr
    rerender = _cli("render", str(DEMO), *_args(tmp_path, "trainer.versions=50"))
    assert rerender.returncode != 0 and f"areal-hpc resume {run}" in rerender.stderr
    assert _files(run) == before

    # more versions, through sbatch, held in the queue first: status says PENDING and why
    more = stopped + 3  # "+3": three more than the checkpoint, wherever the cancel stopped the run
    # (signal_s=0: any version and checkpoint outlast it, so rank 0 must warn that the time limit would lose work)
    out = _cli("resume", str(run), "trainer.versions=+3", "slurm.extra_sbatch=[--hold]", "slurm.signal_s=0", "--sbatch")
    assert out.returncode == 0 and f"resumes from checkpoint v{stopped}" in out.stdout, out.stderr
    new_id = out.stdout.split()[2].rstrip(":")
    held = _cli("status", str(run)).stdout
    assert f"job {new_id}: PENDING (JobHeldUser)" in held and f"not started yet (resumes from v{stopped})" in held
    subprocess.run(["scontrol", "release", new_id], check=True)
    # status at every moment of the new start: never the cancelled start's "v/100000 (finished)" as its own
    said, end = set(), time.time() + 240
    while job_state(new_id) not in DONE and time.time() < end:
        out = _cli("status", str(run)).stdout
        assert "/100000" not in out, out
        said.add(f"progress: starting (resumed from v{stopped})" in out)
        time.sleep(0.5)  # status back to back would hold a core the job's own ranks need
    assert True in said  # seen while its ranks started (seconds: prepare, srun, imports, the weights' publish)
    assert wait_for(new_id, DONE, 240) == "COMPLETED"
    s = json.loads((run / "summary.json").read_text())
    assert s["start_version"] == stopped and s["versions"] == more
    _audit(run, eta=2, versions=more)  # nothing consumed twice across the cancel and the resume
    import yaml

    (entry,) = yaml.safe_load((run / "config-history.yaml").read_text())
    assert entry["from_checkpoint"] == stopped and entry["changes"]["trainer.versions"] == {"from": 100000, "to": more}
    status = _cli("status", str(run)).stdout
    assert f"version {more}/{more}" in status and "more than slurm.signal_s=0" in status, status


def test_status_finds_a_queued_job_that_plain_sbatch_submitted(tmp_path):
    r = _cli("render", str(DEMO), *_args(tmp_path, "slurm.extra_sbatch=[--hold]"))
    assert r.returncode == 0, r.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(r.stdout)
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True)
    job_id = job_id.stdout.strip()
    try:
        status = _cli("status", str(tmp_path / "run"))  # no slurm/job.json yet: found in the queue
        assert f"job {job_id}: PENDING (JobHeldUser)" in status.stdout, status.stdout + status.stderr
        assert "progress: none yet" in status.stdout
        again = _cli("render", str(DEMO), *_args(tmp_path))  # a second job would share the run's folder
        assert again.returncode != 0 and f"job {job_id} of run dir" in again.stderr, again.stderr
    finally:
        subprocess.run(["scancel", job_id], check=True)


def test_scancel_of_an_sbatch_job_is_final(tmp_path):
    job_id = _sbatch(tmp_path, "trainer.versions=100000")
    _wait_version(tmp_path / "run", 1, job_id)
    subprocess.run(["scancel", job_id], check=True)
    assert wait_for(job_id, DONE, 60) == "CANCELLED"
    time.sleep(5)  # the batch script's TERM handler must not have requeued it
    assert job_state(job_id) == "CANCELLED"
    assert "Restarts=0" in subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout


def test_slurm_times_and_sweep_shapes_are_checked(tmp_path):
    from areal_hpc.config import ConfigError, slurm_time_minutes
    from areal_hpc.launch.sweep import sweep

    assert [slurm_time_minutes(t) for t in ("30", "30:00", "1:00:00", "2-12", "1-00:30")] == [30, 30, 60, 3600, 1470]
    with pytest.raises(ConfigError, match="slurm.time='soon' is not a Slurm time"):
        load_config(DEMO, ["slurm.time=soon"])
    with pytest.raises(SlurmError, match="changes the job's shape"):
        sweep(DEMO, {"cluster.n_generators": [1, 2]}, tmp_path / "sw")
    assert not (tmp_path / "sw").exists()  # nothing written, nothing queued
