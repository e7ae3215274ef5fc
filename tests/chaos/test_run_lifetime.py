"""Chaos suite, lifetime: slow or stuck user code never stalls a run, and no process of a run outlives it.

Three real runs under mpirun (`areal-hpc run`), each a fault on top of user code that hangs:
(a) a reward that always sleeps past reward.timeout_s, then SIGTERM to the launcher: the held-out evaluations
    end at logging.eval_timeout_s with their episodes counted as cut, the stop skips the version that can never
    complete (every group is uniform), checkpoints the last completed one and writes the summary;
(b) a tool call that sleeps (a workflow's run_python), then `kill -9` of its generator rank;
(c) the same tool, then `kill -9` of the launcher itself.
After each, no process of that run is left: found by the run's environment marker (AREAL_RUN_DIR), which the
test also sets for the launcher it starts, so the check means the same with a launcher that never set it.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from areal_hpc.rundir import RunDir
from areal_hpc.rundir.lifetime import MARKER, describe, marked

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "areal_hpc.cli"]
EVAL_PROMPTS = 20  # the bar shows "eval=start 0/20"

SLOW_REWARD = """
import time

def reward(completion, row):
    time.sleep(30)  # always past reward.timeout_s
    return 1.0
"""
HANGING_TOOL = """
async def hang(ep):
    await ep.generate()
    await ep.run_python("import time\\ntime.sleep(600)", timeout_s=600)
    return 0.0
"""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tmp_path_factory.mktemp("lifetime") / "model"  # built by the first run, reused by the others


class _Terminal:
    """A pseudo-terminal for the launcher's stderr, read on a thread: what a person at a terminal sees (the
    progress bar; in a file or a pipe the launcher writes plain lines a few times a minute instead)."""

    def __init__(self):
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # 200 columns for the bar
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every writer has closed its end
                break
            if not data:
                break
            self.chunks.append(data)

    def text(self) -> str:
        self.reader.join(timeout=30)
        return b"".join(self.chunks).decode(errors="replace")


def _start(tmp_path: Path, model: Path, *overrides: str, progress: bool = False) -> tuple[subprocess.Popen, Path]:
    """The launcher, with a progress bar on a terminal of its own (`proc.terminal`) or with --no-progress."""
    run = (tmp_path / "run").resolve()
    args = [
        str(ROOT / "jobs" / "demo.yaml"),
        f"store.run_dir={run}",
        f"model.path={model}",
        "trainer.versions=3",
        "trainer.warm_start_steps=2",
        "trainer.max_uniform_batches=0",
        "trainer.max_wall_s=0",
        "logging.trackers=[]",
        *overrides,
    ]
    env = {**os.environ, MARKER: str(run)}
    cmd = [*CLI, "run", *args] + ([] if progress else ["--no-progress"])
    term = _Terminal() if progress else None
    stderr = term.slave if term else subprocess.PIPE
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    proc.terminal = term
    if term:
        os.close(term.slave)  # the launcher holds it now: the reader sees EIO once the launcher's side closes
        term.reader.start()
    return proc, run


def _wait(proc: subprocess.Popen, what: str, cond, timeout: float = 240):
    end = time.time() + timeout
    while time.time() < end:
        if (got := cond()) is not None and got is not False:
            return got
        assert proc.poll() is None, f"the run ended while waiting for {what}: {(proc.communicate()[1] or '')[-2000:]}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _nothing_left(run: Path, timeout: float = 60) -> None:
    """No process carries the run's marker any more (a sanity bound for teardown, not a speed check)."""
    end = time.time() + timeout
    while (left := marked(run)) and time.time() < end:
        time.sleep(0.5)
    assert not left, "left running: " + "; ".join(describe(p) for p in left)


def _sandbox(run: Path) -> int | None:
    """A tool sandbox of the run (the sandboxed `python3 -I -S -`, under bwrap or not), once one runs."""
    for pid in marked(run):
        if "-I -S -" in describe(pid):
            return pid
    return None


def test_a_hanging_reward_then_sigterm_stops_at_the_last_version_with_a_summary(tmp_path, model_path):
    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    proc, run = _start(
        tmp_path,
        model_path,
        f"reward.fn={tmp_path / 'slow.py'}:reward",
        "reward.timeout_s=1",
        "reward.num_workers=1",
        f"logging.eval_prompts={EVAL_PROMPTS}",
        "logging.eval_timeout_s=6",
        progress=True,
    )
    try:
        # the first evaluation after the warm start, running: its progress reaches progress.json (the bar)
        def start_eval():
            p = RunDir(run).read_progress()
            return p if p and (p.get("eval") or {}).get("tag") == "start" else None

        shown = _wait(proc, "the 'start' evaluation's progress", start_eval)["eval"]
        assert shown["total"] == EVAL_PROMPTS and 0 <= shown["done"] <= EVAL_PROMPTS
        rank0_log = RunDir(run).logs / "rank000-scheduler.log"
        _wait(proc, "the 'start' evaluation cut", lambda: "held-out start:" in rank0_log.read_text())
        t_term = time.time()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
        err = proc.terminal.text()
        print(f"\n[chaos] a hanging reward, then SIGTERM: the run ended {time.time() - t_term:.1f} s later")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "versions:" in out and "held-out:" in out  # the summary, printed
    assert "held-out episodes cut unfinished" in out  # the cut evaluations, said so
    assert "eval=start 0/20" in err  # the progress bar showed the evaluation: episodes done / total
    s = json.loads((run / "summary.json").read_text())
    # every group scored 0 (uniform): version 1 could never complete, and the stop did not wait for it
    assert s["stop_reason"] == "stop requested" and s["versions"] == 0
    assert RunDir(run).latest_checkpoint() == 0
    # the evaluations ended at their bound: cut episodes counted, none scored as a wrong answer
    assert s["heldout_cut"] >= EVAL_PROMPTS and s["heldout_cut_final"] > 0
    if s["heldout_cut_final"] == EVAL_PROMPTS:  # no episode finished: no accuracy, not 0%
        assert math.isnan(s["acc_final"])
    _nothing_left(run)


def test_b_a_hanging_tool_then_kill9_of_its_generator_leaves_nothing(tmp_path, model_path):
    (tmp_path / "hang.py").write_text(HANGING_TOOL)
    proc, run = _start(tmp_path, model_path, f"workflow.fn={tmp_path / 'hang.py'}:hang", "logging.eval_prompts=2")
    try:
        _wait(proc, "a tool sandbox", lambda: _sandbox(run))
        generator = int(RunDir(run).rank_pid(1).read_text())  # generator 0 runs the held-out episodes too
        t_kill = time.time()
        os.kill(generator, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        print(
            f"\n[chaos] a hanging tool, then kill -9 of its generator: the run ended {time.time() - t_kill:.1f} s later"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert "process rank 1" in err and "signal 9" in err  # one line naming the rank that died
    _nothing_left(run)


def test_c_kill9_of_the_launcher_leaves_nothing(tmp_path, model_path):
    (tmp_path / "hang.py").write_text(HANGING_TOOL)
    proc, run = _start(tmp_path, model_path, f"workflow.fn={tmp_path / 'hang.py'}:hang", "logging.eval_prompts=2")
    try:
        _wait(proc, "a tool sandbox", lambda: _sandbox(run))
        t_kill = time.time()
        proc.kill()  # SIGKILL: the launcher gets no chance to stop anything itself
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    _nothing_left(run)
    print(f"\n[chaos] a hanging tool, then kill -9 of the launcher: nothing left {time.time() - t_kill:.1f} s later")
