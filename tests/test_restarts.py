"""Why a world died, and whether the job starts it again: rank error files, their kinds and srun's lines."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

from areal_hpc.launch.restarts import death_cause, error_line, restarts_line
from areal_hpc.rundir import RunDir
from areal_hpc.runtime.failures import OWN, PEER, STARTUP, error_file_text, kind_of

START = "[areal] 10:00:00 job 7 starting on h (requeue count 0, restart 0 of at most 2)\n"
# what srun printed when a trainer failed at start-up (the local cluster, issue 36): the scheduler, killed
# by srun once the trainer aborted, comes first
ABORTED = "srun: error: n1: task 0: Killed\nsrun: error: n1: task 1: Exited with exit code 1\n"
MISSING = (
    "rank 1 (trainer) failed: RuntimeError: Error(s) in loading state_dict for LlamaForCausalLM: Missing key(s) in "
    'state_dict: "model.norm.weight".'
)


def _raised(make):
    try:
        make()
    except BaseException as err:  # noqa: BLE001 - the test hands any error to kind_of, as the worker does
        return err


def _from(outer: Exception, inner: Exception):
    def make():
        try:
            raise inner
        except Exception as e:
            raise outer from e

    return make


def test_error_kinds_name_start_up_errors_that_would_repeat_and_lost_peers():
    missing = RuntimeError(MISSING.split("RuntimeError: ")[1])
    assert kind_of(missing, loop_started=False) == STARTUP  # the checkpoint does not fit: it never will
    assert kind_of(missing, loop_started=True) == OWN  # mid-run: restarted as before
    from areal_hpc import data

    # this project's check of the user's data (a ValueError raised in areal_hpc)
    bad_rows = _raised(lambda: data.load_math_dataset(__file__, "jsonl", prompt_template="no fields"))
    assert isinstance(bad_rows, ValueError) and kind_of(bad_rows, False) == STARTUP
    # an engine that could not start (the last world may still hold the GPU): restarted
    free = _raised(lambda: (_ for _ in ()).throw(ValueError("Free memory on device (7.1/79.1 GiB) on startup")))
    assert kind_of(free, False) == kind_of(RuntimeError("Engine core initialization failed"), False) == OWN
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]")
    assert kind_of(gloo, False) == kind_of(gloo, True) == PEER
    assert kind_of(RuntimeError("weight broadcast of version 4 failed (see the log)"), True) == PEER
    assert kind_of(_raised(_from(RuntimeError("sync failed"), ConnectionResetError(104, "reset"))), False) == PEER
    assert kind_of(RuntimeError("NCCL error: unhandled system error"), False) == PEER

    class MpiError(Exception):  # stands for mpi4py's MPI.Exception, which the worker passes
        pass

    assert kind_of(MpiError("MPI_ERR_OTHER: known error not in list"), False, (MpiError,)) == PEER
    # the machine, not the run's inputs: a new world may pass
    assert kind_of(OSError(errno.ENOSPC, "No space left on device"), False) == OWN
    assert kind_of(MemoryError(), False) == OWN
    assert kind_of(RuntimeError("CUDA error: out of memory"), False) == OWN
    assert kind_of(KeyboardInterrupt(), False) == OWN


def _world(tmp_path, errors: dict[int, tuple[str, str | None]], srun: str = ABORTED):
    rd = RunDir(tmp_path)
    rd.logs.mkdir(parents=True, exist_ok=True)
    for rank, (line, kind) in errors.items():  # written in this order (the first is the first written)
        rd.rank_error(rank).write_text(error_file_text(line, kind) if kind else line + "\n")
        t = (1_700_000_000 + rank) * 10**9
        os.utime(rd.rank_error(rank), ns=(t, t))
    out = tmp_path / "logs" / "slurm-7.out"
    out.write_text(START + srun)
    return out


def test_a_rank_s_own_error_is_the_cause_not_srun_s_kill_of_its_peers(tmp_path):
    out = _world(tmp_path, {1: (MISSING, STARTUP)})
    assert death_cause(tmp_path, 137, 0.0, out) == MISSING  # before: "a task was killed by a signal: ... task 0"
    # a rank killed by kill -9 writes nothing; its peers' failed exchanges are echoes: srun's line stays the cause
    broadcast = "rank 1 (trainer) failed: RuntimeError: weight broadcast of version 4 failed (see the log)"
    out = _world(tmp_path, {1: (broadcast, PEER)}, "srun: error: n2: task 0: Killed\n")
    assert death_cause(tmp_path, 137, 0.0, out).startswith("a task was killed by a signal: srun says n2: task 0")


def _restarts(tmp_path, *args):
    env = {**os.environ, "SLURM_JOB_ID": "7"}
    cmd = [sys.executable, "-m", "areal_hpc.launch.restarts", str(tmp_path), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_the_job_restarts_no_world_that_failed_at_start_up_and_says_why(tmp_path):
    _world(tmp_path, {1: (MISSING, STARTUP)})
    r = _restarts(tmp_path, "1", "137", "0", "", "2")
    assert r.returncode == 2 and r.stdout.strip() == f"not restarting: {MISSING}: it would fail the same way"
    (died,) = json.loads(RunDir(tmp_path).restarts.read_text())  # the death and its cause, without a restart
    assert died["restarted"] is False and died["cause"] == MISSING and died["job_id"] == "7"
    assert restarts_line(tmp_path, "7") is None  # status counts restarts: there was none
    assert error_line(tmp_path, "7") == MISSING  # what `areal-hpc status` shows as its error line

    # the same error in the loop: restarted, and restarts.json names it, with the job
    _world(tmp_path, {1: (MISSING, OWN)})
    r = _restarts(tmp_path, "1", "137", "0", "", "2")
    assert r.returncode == 0 and r.stdout.strip() == f"restart 1 from the start: {MISSING}", r.stdout
    entry = json.loads(RunDir(tmp_path).restarts.read_text())[-1]
    assert entry["cause"] == MISSING and entry["job_id"] == "7" and entry["restarted"] is True
    assert restarts_line(tmp_path, "7").startswith("restarts: 1 (last at ") and MISSING in restarts_line(tmp_path, "7")
    # past slurm.max_restarts: the job gives up with the cause, and status shows that once the files are gone
    r = _restarts(tmp_path, "3", "137", "0", "", "2")
    assert r.returncode == 2
    assert r.stdout.strip() == f"giving up: the world died 3 times (slurm.max_restarts=2); the last time: {MISSING}"
    for p in RunDir(tmp_path).rank_errors():
        p.unlink()
    with open(tmp_path / "logs" / "slurm-7.out", "a") as f:
        f.write(f"[areal] 10:01:00 {r.stdout}")
    assert error_line(tmp_path, "7") == r.stdout.strip()
    assert error_line(tmp_path, "8") is None  # another job's output says nothing of this one
