"""Slurm end to end on the local cluster: jobs that must end, refuse or be refused (dead worlds, a start-up
failure after a resume, one job per run directory, requests that cannot work)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from test_slurm import (  # noqa: F401 - slurm_cluster: the module fixture that starts the cluster
    CLI,
    DEMO,
    DONE,
    ROOT,
    _args,
    _audit,
    _cli,
    _files,
    _sbatch,
    _wait_version,
    _world_starts,
    slurm_cluster,
)

from areal_hpc.config import load_config
from areal_hpc.launch.slurm import job_state, wait_for
from areal_hpc.rundir import RunDir


def _script_and_fake_bin(tmp_path, *overrides) -> tuple[Path, Path]:
    """The demo's rendered job script, to run with bash, and an empty folder for a stand-in `srun` on PATH."""
    r = _cli("render", str(DEMO), *_args(tmp_path, *overrides))
    assert r.returncode == 0, r.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(r.stdout)
    fake = tmp_path / "bin"
    fake.mkdir()
    return script, fake


def test_batch_script_ends_an_srun_that_outlives_a_finished_run(tmp_path):
    # Seen once in CI: every rank exited and both steps ended, yet srun never returned. A real srun
    # cannot be made to hang on demand, so a stand-in `srun` plays one: it writes the run's summary
    # (what rank 0 does last) and then ignores TERM. A second one fails without a summary.
    script, fake = _script_and_fake_bin(tmp_path)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_JOB_ID": "0", "AREAL_EXIT_GRACE_S": "1", "HOME": str(tmp_path)}
    summary = RunDir(tmp_path / "run").summary

    (fake / "srun").write_text(f"#!/bin/bash\ntrap '' TERM\necho '{{}}' > {summary}\nexec sleep 600\n")
    (fake / "srun").chmod(0o755)
    t0 = time.time()
    slow = {**env, "AREAL_EXIT_GRACE_S": "4"}
    job = subprocess.Popen(["bash", str(script)], env=slow, stdout=subprocess.PIPE, text=True)
    while not summary.exists() and time.time() - t0 < 300:  # a hang guard
        time.sleep(0.2)
    time.sleep(1.5)  # the script has seen the new summary; the time limit's signal comes now
    job.send_signal(signal.SIGUSR1)
    stdout, _ = job.communicate(timeout=120)
    assert job.returncode == 0, stdout
    assert "srun still running 4 s after the run finished; ending it" in stdout
    assert "after the run finished: nothing to requeue" in stdout and "requeueing job" not in stdout
    assert "srun ended with code 0" in stdout  # not srun's own sleep 600: communicate's limit is 120 s

    summary.unlink()
    (fake / "srun").write_text("#!/bin/bash\nsleep 1\nexit 3\n")
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3 and "srun ended with code 3" in out.stdout and "ending it" not in out.stdout


def test_one_job_per_run_dir_and_a_resume_keeps_the_run_s_model(tmp_path):
    from areal_hpc.launch.jobs import run_jobs
    from areal_hpc.launch.resume import plan_resume
    from areal_hpc.model import build_tiny_model

    # the same rendered script submitted twice: the second (held until the first runs) refuses to start
    # (60 versions: the first job still runs, with half a minute to spare here, when the second has ended)
    r = _cli("render", str(DEMO), *_args(tmp_path, "trainer.versions=60"))
    assert r.returncode == 0, r.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(r.stdout)
    sbatch = ["sbatch", "--parsable", str(script)]
    first = subprocess.run(sbatch, capture_output=True, text=True, check=True).stdout.strip()
    run = tmp_path / "run"
    end = time.time() + 120
    while not RunDir(run).job_file.exists():  # written by the job's prepare, after it claimed the run
        assert job_state(first) not in DONE and time.time() < end, job_state(first)
        time.sleep(0.2)
    second = subprocess.run([*sbatch[:2], "--hold", str(script)], capture_output=True, text=True, check=True)
    second = second.stdout.strip()
    try:
        status = _cli("status", str(run)).stdout
        assert f"job {first}: RUNNING" in status, status
        assert f"also: job {second} PENDING (JobHeldUser; will refuse to start while job {first} runs" in status
        assert [j for j, _ in run_jobs(run)] == [first, second]  # what `areal-hpc cancel` cancels
        subprocess.run(["scontrol", "release", second], check=True)
        assert wait_for(second, DONE, 120) == "FAILED"
        assert job_state(first) == "RUNNING"  # undisturbed
        out = (run / "logs" / f"slurm-{second}.out").read_text().splitlines()
        assert out == [
            f"[areal] job {second} refused to start: job {first} (RUNNING) owns run dir {str(run)!r} (one job per "
            f"run directory); nothing in it was touched (areal-hpc status {run})"
        ], out
        assert wait_for(first, DONE, 240) == "COMPLETED"
    finally:
        subprocess.run(["scancel", first, second], check=False)
    assert json.loads(RunDir(run).job_file.read_text())["job_id"] == first and _world_starts(run) == 1
    assert "Restarts=0" in subprocess.run(["scontrol", "show", "job", second], capture_output=True, text=True).stdout
    _audit(run, eta=2, versions=60)

    # resume: another model (the same config.json, other weights) or a folder that does not exist, even with
    # build_tiny, is refused in one line, and nothing is written
    m = load_config(run / "config.yaml").model
    shape = {k: getattr(m, k) for k in ("arch", "hidden_size", "intermediate_size", "num_layers", "num_heads")}
    other = build_tiny_model(tmp_path / "other", **shape, seed=1)
    assert (other / "config.json").read_text() == (tmp_path / "model" / "config.json").read_text()
    missing = tmp_path / "nowhere" / "model"
    before = _files(run)
    for path, words in ((other, "is another model: its weights' sha256"), (missing, "does not exist")):
        out = _cli("resume", str(run), "trainer.versions=70", f"model.path={path}", "model.build_tiny=true")
        assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1 and words in out.stderr, out.stderr
    # a teacher where the run distilled from none: refused before the job is queued (its script would refuse it);
    # uniform groups kept, as a distilling run should (else a config warning comes before the refusal)
    out = _cli("resume", str(run), "trainer.versions=70", f"distill.teacher={other}", "ppo.drop_uniform_groups=false")
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "started without distillation" in out.stderr, out.stderr
    assert not missing.parent.exists() and _files(run) == before
    # a run from before model.json: compared with its model.path's files while they are there
    RunDir(run).model.rename(tmp_path / "model.json")
    out = _cli("resume", str(run), "trainer.versions=70", f"model.path={other}")
    assert out.returncode != 0 and "is another model" in out.stderr, out.stderr
    (tmp_path / "model.json").rename(RunDir(run).model)
    # the same files, moved, are the run's model
    moved = shutil.copytree(tmp_path / "model", tmp_path / "moved")
    cfg, changes, ckpt = plan_resume(run, ["trainer.versions=70", f"model.path={moved}"])
    assert ckpt == 60 and changes["model.path"]["to"] == str(moved)


def test_render_and_submit_list_every_problem_at_once_and_write_nothing(tmp_path):
    # the GPU recipe on this 4-node CPU cluster: both components' CPUs, the GPUs, the model folder, the signal, the time
    where = [f"model.path={tmp_path / 'm'}", f"data.path={tmp_path / 'd.jsonl'}", f"store.run_dir={tmp_path / 'gpu'}"]
    bad = [str(ROOT / "jobs" / "math_1p5b_gpu.yaml"), *where, "slurm.signal_s=60", "slurm.time=00:05:00"]
    for cmd in ("render", "submit"):
        r = _cli(cmd, *bad)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and r.stdout == "" and lines[0] == f"Error: {cmd} refused: 6 problems:", r.stderr
        for words in (
            "the training component needs 9 tasks",
            "the generation component needs 24 tasks",
            "slurm.gpus_per_node=8 but nodes of partition 'debug' have 0 GPUs",
            f"model folder '{tmp_path / 'm'}' does not exist",
            "slurm.signal_s=60 is shorter than one version plus a checkpoint",
            "slurm.time=00:05:00 leaves no room before slurm.signal_s=60",
        ):
            assert sum(words in ln for ln in lines[1:]) == 1, (words, r.stderr)
        assert list(tmp_path.iterdir()) == []  # no run dir, no logs


def test_a_time_limit_with_no_room_before_its_signal_is_refused_in_one_line(tmp_path):
    # the slurm.time=00:01:00 with the default 120 s signal: USR1 at once, a requeue for ever
    for cmd in ("render", "submit"):
        r = _cli(cmd, str(DEMO), *_args(tmp_path, "slurm.time=00:01:00"))
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "slurm.time=00:01:00 leaves no room before slurm.signal_s=120" in r.stderr, r.stderr
        assert "set slurm.time=00:03:00 or more" in r.stderr and not (tmp_path / "run").exists()
    # GPU: start-up, then the simulated version and its checkpoint, must come before the signal
    gpu = [str(ROOT / "jobs" / "math_1p5b_gpu.yaml"), f"model.path={tmp_path}", f"data.path={tmp_path / 'd.jsonl'}"]
    r = _cli("render", "--no-check", *gpu, f"store.run_dir={tmp_path / 'gpu'}", "slurm.time=00:15:00")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "slurm.time=00:15:00 leaves no room before slurm.signal_s=600" in r.stderr and "(simulated)" in r.stderr
    # what the preemption run used (it requeued twice and made progress) still renders
    assert _cli("render", str(DEMO), *_args(tmp_path, "slurm.time=00:02:00", "slurm.signal_s=60")).returncode == 0


def test_batch_script_ends_a_dead_world_and_times_this_start_s_heartbeat(tmp_path):
    # Stand-ins for srun, as above. The first plays the issue's: a trainer's checkpoint did not load (its error
    # file, as the worker writes it), the steps ended, and srun never returned; rank 0 still beats. The
    # script must end it AREAL_EXIT_GRACE_S after the error, fail, and not restart a start-up error.
    script, fake = _script_and_fake_bin(tmp_path, "cluster.hang_timeout_s=4", "slurm.max_restarts=0")
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_JOB_ID": "0", "AREAL_EXIT_GRACE_S": "2", "HOME": str(tmp_path)}
    rd = RunDir(tmp_path / "run")
    line = 'rank 1 (trainer) failed: RuntimeError: Error(s) in loading state_dict: Missing key(s) in state_dict: "w".'
    (fake / "srun").write_text(
        f"#!/bin/bash\ntrap '' TERM\nprintf '%s\\nkind: start-up\\n' '{line}' > {rd.rank_error(1)}\n"
        f"while :; do touch {rd.heartbeat}; sleep 0.5; done\n"
    )
    (fake / "srun").chmod(0o755)
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    ended_after = time.time() - rd.rank_error(1).stat().st_mtime
    assert out.returncode != 0 and "s ago (logs/error-rank*.txt) and srun is still running; ending it" in out.stdout
    assert f"not restarting: {line}: it would fail the same way" in out.stdout, out.stdout
    assert out.stdout.count(" starting on ") == 1  # no restart: restarts.json has the death, not restarted
    assert [(d["restarted"], d["cause"]) for d in json.loads(rd.restarts.read_text())] == [(False, line)]
    assert ended_after < 2 + 10 + 20, out.stdout  # the grace, 10 s from TERM to KILL, slack for a busy machine

    # The second starts a world whose rank 0 never writes a heartbeat, with an earlier job's heartbeat.json
    # still there: quiet from this world's start, it is ended hang_timeout_s (4 s) later.
    rd.heartbeat.write_text("{}")
    os.utime(rd.heartbeat, (time.time() - 30, time.time() - 30))
    (fake / "srun").write_text("#!/bin/bash\nexec sleep 600\n")
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    quiet = re.search(r"rank 0 \(scheduler\) wrote no heartbeat for (\d+) s", out.stdout)
    assert out.returncode != 0 and quiet and 4 < int(quiet.group(1)) <= 4 + 3, out.stdout
    assert "giving up: the world died once (slurm.max_restarts=0); the last time: rank 0" in out.stdout
    assert not rd.heartbeat.exists()  # the earlier job's was removed before this world started


def _srun_of(job_id: str) -> list[int]:
    """The pids of job `job_id`'s srun on this host (the local cluster's nodes are all here)."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "comm").read_text().strip() == "srun":
                if f"SLURM_JOB_ID={job_id}".encode() in (p / "environ").read_bytes().split(b"\0"):
                    pids.append(int(p.name))
        except OSError:
            continue
    return pids


def test_a_resume_that_fails_at_start_up_ends_failed_with_its_error_in_status(tmp_path):
    # The case: a run trains, then its trainer checkpoint no longer fits the model (a key gone, as with
    # another model's files), and `areal-hpc resume` starts a job whose trainer fails at start-up, with the first
    # job's heartbeat.json still there. Its srun is stopped once the ranks are up: the stand-in for the srun
    # that never returned. The job must end FAILED within the grace + 10 s, restart nothing (it would fail
    # the same way), and show the trainer's own error, not srun's kill of its peers, in status.
    from safetensors.torch import load_file, save_file

    first = _sbatch(tmp_path, "trainer.versions=2")
    run = tmp_path / "run"
    assert wait_for(first, DONE, 240) == "COMPLETED"
    rd = RunDir(run)
    assert rd.heartbeat.exists()
    weights = rd.trainer_checkpoint(2) / "model.safetensors"
    sd = load_file(weights)
    del sd["model.norm.weight"]
    save_file(sd, weights, metadata={"format": "pt"})
    grace = 10  # AREAL_EXIT_GRACE_S (60 s by default): reaches the job through sbatch's environment
    env = {**os.environ, "AREAL_EXIT_GRACE_S": str(grace)}
    r = subprocess.run(
        [*CLI, "resume", str(run), "trainer.versions=4", "--sbatch"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr
    job_id, t0 = r.stdout.split()[2].rstrip(":"), time.time()
    try:
        while len([p for p in rd.logs.glob("rank*.pid") if p.stat().st_mtime >= t0]) < 4:
            assert job_state(job_id) not in DONE and time.time() - t0 < 600, job_state(job_id)  # a hang guard
            time.sleep(0.1)
        for pid in _srun_of(job_id):
            os.kill(pid, signal.SIGSTOP)
        assert wait_for(job_id, DONE, grace + 10 + 120) == "FAILED"
    finally:
        subprocess.run(["scancel", job_id], check=False)  # a failed test leaves no job on the shared cluster
    ended_after = time.time() - rd.rank_error(1).stat().st_mtime
    print(
        f"\n[slurm] a start-up failure after a resume: error file -> job FAILED {ended_after:.1f} s (grace {grace} s)"
    )
    assert ended_after < grace + 10 + 30  # the grace, TERM to KILL, slack for a busy machine
    out = (run / "logs" / f"slurm-{job_id}.out").read_text()
    error = "rank 1 (trainer) failed: RuntimeError: Error(s) in loading state_dict for LlamaForCausalLM: Missing key(s)"
    assert "srun is still running; ending it" in out and f"not restarting: {error}" in out, out
    assert "it would fail the same way" in out and out.count(" starting on ") == 1  # no in-job restart
    status = _cli("status", str(run)).stdout
    assert f"job {job_id}: FAILED" in status and f"error: {error}" in status, status
    assert "killed by a signal" not in status and "restarts:" not in status, status
