"""Chaos suite, storage: the run directory's filesystem fills up, then turns read-only, mid-run.

The run directory lies on a size-limited tmpfs (a real filesystem with a real ENOSPC and EROFS). Each
fault must stop the run with one line naming it, leave no half-written file under a final name, and
be recovered by the one documented command, `areal-hpc run --resume RUN_DIR`, once the disk is fixed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from safetensors.torch import load_file

from areal_hpc.rundir import RunDir
from areal_hpc.store import Ledger, list_shards, load_trajectories, read_shard

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "areal_hpc.cli"]
# 16 versions: a demo version takes about 0.3 s here, and the read-only mount must land well before the
# resumed run's last one (CI once saw the resumed run finish first and exit 0)
B, N, ETA, VERSIONS = 8, 8, 2, 16


@pytest.fixture
def small_fs(tmp_path):
    """A 16 MB tmpfs: two of the demo's checkpoints (6 MB each) and a few shards fill it."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-R", "-l", str(mnt)], check=False)


def _remount(mnt: Path, opts: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{opts}", str(mnt)], check=True)


def _whole(run: Path) -> None:
    """Every file under a final name is complete: shards verify, JSON parses, checkpoints load, metrics
    rows are whole. Only temporaries (which a resume deletes) may be left, by ranks killed mid-write."""
    for p in list_shards(run / "rollouts"):
        read_shard(p)  # raises CorruptShardError on a torn or damaged file
    rd = RunDir(run)
    for p in [*rd.ledger.glob("*.json"), *rd.checkpoints.glob("*.json"), rd.progress]:
        if p.exists():
            json.loads(p.read_text())
    for v in range((rd.latest_checkpoint() or 0) + 1):
        if rd.scheduler_state(v).exists():
            assert load_file(str(rd.trainer_checkpoint(v) / "model.safetensors"))
    if rd.metrics.exists():
        m = pd.read_csv(rd.metrics)
        trained = m[m["version"] >= 1]  # row 0 is the starting weights' (no reward)
        assert m["version"].notna().all() and trained["reward_mean"].notna().all()
    # temporaries (a name with .tmp, which the resume removes) lie only where atomic writes put them
    temps = [p for p in run.rglob("*") if ".tmp" in p.name]
    assert all(p.parent in (*rd.durable_dirs, run, rd.logs) for p in temps), temps


def _mount(*args: str) -> int:
    """mount(8), retried: one suite run saw the read-only remount fail once (exit 32) where it passes alone.
    Returns the failed tries."""
    for tries in range(3):
        r = subprocess.run(["mount", *args], capture_output=True, text=True)
        if r.returncode == 0:
            return tries
        time.sleep(0.2)
    raise AssertionError(f"mount {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")


def _story(run: Path, at_ro: int | None, t_ro: float, err: str) -> str:
    """What a run that went on past the read-only mount did: for a failure message."""
    path = RunDir(run).logs / "rank000-scheduler.log"
    log = path.read_text().splitlines() if path.exists() else []
    mtimes = sorted((p.stat().st_mtime - t_ro, str(p.relative_to(run))) for p in run.rglob("*") if p.is_file())
    return (
        f"checkpoint v{at_ro} at the mount; newest writes (s after it): {mtimes[-8:]}; log: {log[-15:]}; {err[-1500:]}"
    )


def _run(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "run", *args, "--no-progress"], capture_output=True, text=True, timeout=timeout)


def test_a_full_disk_then_a_read_only_one_stop_the_run_in_one_line_and_resume_loses_nothing(small_fs, tmp_path):
    run = small_fs / "run"
    r = _run(
        str(ROOT / "jobs" / "demo.yaml"),
        f"store.run_dir={run}",
        f"model.path={tmp_path / 'model'}",  # outside the small filesystem
        f"rollout.batch_prompts={B}",
        f"rollout.eta={ETA}",
        f"trainer.versions={VERSIONS}",
        "trainer.checkpoint_every=1",
        "trainer.max_wall_s=0",
        "logging.eval_prompts=20",
        "logging.eval_every=0",
        "logging.trackers=[]",
    )
    t_stopped = time.time()
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0], r.stderr[-2000:]
    t_failed = min(p.stat().st_mtime for p in RunDir(run).rank_errors())  # the first rank's failed write
    print(f"\n[chaos] full disk at v{RunDir(run).latest_checkpoint()}: stopped {t_stopped - t_failed:.1f} s after")
    print(f"[chaos] the first failed write: {lines[0]}")
    _whole(run)
    stopped_at = RunDir(run).latest_checkpoint()
    assert stopped_at is not None and stopped_at < VERSIONS

    # room made; the resumed run then loses its filesystem's write access mid-run
    _remount(small_fs, "size=256m")
    proc = subprocess.Popen(
        [*CLI, "run", "--resume", str(run), "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    end = time.time() + 240
    while time.time() < end and proc.poll() is None:
        if (RunDir(run).latest_checkpoint() or 0) >= stopped_at + 1:  # the resumed run has made progress
            break
        time.sleep(0.05)
    t_mount = time.time()
    try:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        # read-only from now on: a read-only bind mount over the run directory (a plain remount refuses while
        # the ranks hold log files open; files already open stay writable, as on a server that turns read-only)
        failed = _mount("--bind", str(run), str(run)) + _mount("-o", "remount,bind,ro", str(run))
        t_ro, at_ro = time.time(), RunDir(run).latest_checkpoint()
        version = json.loads(RunDir(run).progress.read_text())["version"]
        print(
            f"[chaos] read-only at checkpoint v{at_ro}, version {version}"
            f" ({failed} failed mount tries, {t_ro - t_mount:.2f} s)"
        )
        _, err = proc.communicate(timeout=120)
        t_stopped = time.time()
    finally:
        if proc.poll() is None:  # a failed step must not leave a run writing into the fixture's folder
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, _story(run, at_ro, t_ro, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Read-only file system" in lines[0], err[-2000:]
    at = RunDir(run).latest_checkpoint()
    print(f"[chaos] read-only at v{at}: stopped {t_stopped - t_ro:.1f} s later: {lines[0]}")
    _whole(run)

    subprocess.run(["umount", str(run)], check=True)
    t_resume, resumed_from = time.time(), RunDir(run).latest_checkpoint()
    r = _run("--resume", str(run))
    assert r.returncode == 0, r.stderr[-2000:]
    print(f"[chaos] --resume from v{resumed_from} finished v{VERSIONS} in {time.time() - t_resume:.1f} s")
    _whole(run)
    ledger = Ledger(run)  # raises on a trajectory consumed twice
    df = load_trajectories(run)
    eaten = df[df["consumed_version"] >= 0]
    assert df.attrs["unmatched_ledger_entries"] == 0
    assert len(eaten) == len(ledger.consumed()) == VERSIONS * B * N
    assert (eaten["staleness"] <= ETA).all()
    after = eaten[eaten["consumed_version"] > stopped_at]["staleness"].max()
    print(f"[chaos] max staleness after the first stop: {after}")
    assert set(range(1, VERSIONS + 1)) <= set(pd.read_csv(run / "metrics.csv")["version"].astype(int))
