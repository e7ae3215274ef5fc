"""Slow user code never stalls a run, and nothing outlives it: held-out evaluations end at their bound, reward
work nobody waits for is never scored, and the reward pool's processes die with their owner (real pools)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from areal_hpc.reward import RewardPool
from areal_hpc.reward.bounds import ERROR, OK
from areal_hpc.rundir.lifetime import MARKER, describe, marked

ROOT = Path(__file__).resolve().parents[1]


def _logged(completion: str, row: dict) -> float:
    """Notes each call in row['log'], then sleeps row['sleep'] seconds."""
    with open(row["log"], "a") as f:
        f.write(completion + "\n")
    time.sleep(row.get("sleep", 0))
    return 1.0


def _gone(pids: list[int], timeout: float = 60) -> list[int]:
    """The pids still alive (zombies aside) after waiting up to timeout (a sanity bound, not a speed check)."""

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    end = time.time() + timeout
    while (left := [p for p in pids if alive(p)]) and time.time() < end:
        time.sleep(0.2)
    return left


def test_discarded_items_are_never_scored_and_a_closing_pool_drops_its_queue(tmp_path):
    log = tmp_path / "calls.txt"
    row = {"log": str(log), "sleep": 3}
    pool = RewardPool(num_workers=1, timeout_s=10, scorer=_logged, max_chunk=1)
    assert pool.warmup(120)
    workers = list(pool._gen.executor._processes)
    batch = pool.submit(["a0", "a1", "a2", "a3"], [row] * 4)  # a0 runs; a1..a3 wait in the queue
    pool.discard(batch, [1, 2, 3])  # their episodes were cancelled (an evaluation cut)
    scores = batch.result(timeout=120)
    assert scores.statuses == [OK, ERROR, ERROR, ERROR] and scores[0] == 1.0
    # a hanging batch behind it, then the pool closes without finishing it: every item resolves, none runs twice
    late = pool.submit(["b0", "b1", "b2"], [{"log": str(log), "sleep": 600}] * 3)
    while "b0" not in log.read_text():
        time.sleep(0.05)
    pool.close(finish_queued=False)
    assert late.result(timeout=30).statuses == [ERROR] * 3
    assert log.read_text().split() == ["a0", "b0"]  # a1..a3 and b1, b2 never reached the reward function
    assert _gone(workers) == []  # b0's worker was killed mid-call


def test_reward_workers_die_with_the_process_that_owns_the_pool(tmp_path):
    """kill -9 of a pool's owner (a generator rank): its workers and the forkserver end too. Before, a worker
    held the forkserver's pipe and its task queue's, so both ran on with parent PID 1."""
    owner = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from areal_hpc.reward import RewardPool\n"
        "from areal_hpc.reward.functions import MathAnswer\n"
        "if __name__ == '__main__':\n"
        "    pool = RewardPool(num_workers=2, timeout_s=5, scorer=MathAnswer())\n"
        "    pool.warmup(120)\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n"
    )
    script = tmp_path / "owner.py"
    script.write_text(owner)
    env = {**os.environ, MARKER: str(tmp_path)}  # the owner and everything it starts carry it
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        family = [p for p in marked(tmp_path) if p != proc.pid]
        assert len(family) >= 3, [describe(p) for p in family]  # 2 workers, the forkserver, the resource tracker
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = _gone(family)
        assert not left, "outlived their owner: " + "; ".join(describe(p) for p in left)
    finally:
        if proc.poll() is None:
            proc.kill()


async def _score_row(ep) -> float:
    """A workflow that only scores (no engine): the completion names the row. The slow rows ask a moment later,
    so their reward calls go to the pool as a batch of their own (a batch is answered once all of it is)."""
    if ep.row["sleep"]:
        await asyncio.sleep(0.5)
    return await ep.reward(str(ep.row["i"]))


def test_a_heldout_evaluation_past_its_bound_ends_with_what_it_has(tmp_path, tiny_model_dir):
    from areal_hpc.config.task import WorkflowConfig
    from areal_hpc.data import Problem
    from areal_hpc.evaluation.heldout import HeldoutEvals
    from areal_hpc.model import load_tokenizer
    from areal_hpc.workflow.runner import EpisodeRunner, RunnerSettings

    log = tmp_path / "calls.txt"
    rows = [{"i": i, "log": str(log), "sleep": 0 if i < 2 else 600} for i in range(6)]  # 2 answer, 4 hang
    pool = RewardPool(num_workers=2, timeout_s=1000, scorer=_logged, max_chunk=1)
    settings = RunnerSettings(workflow=WorkflowConfig(), max_new_tokens=8)
    runner = EpisodeRunner(_score_row, load_tokenizer(tiny_model_dir), pool, lambda reqs: None, settings)
    reports, progress = [], []
    evals = HeldoutEvals(
        [Problem(i, "q", "", [1], row) for i, row in enumerate(rows)],
        runner,
        1,
        True,
        reports.append,
        lambda t0, t1: None,
        1.0,
    )
    evals.bound(3.0, runner.cancel, progress.append)
    assert pool.warmup(120)
    evals.asked.append("v1")
    evals.start_next(0)
    end = time.time() + 120  # a sanity bound: the evaluation's own is 3 s
    while evals.busy and time.time() < end:
        for ep in runner.poll(engine_idle=True):
            evals.episode_done(ep.key.index, ep)
        evals.tick(time.time())
        time.sleep(0.05)
    pool.close(finish_queued=False)
    runner.close()
    (result,) = reports
    # the 2 that finished are the figures; the 4 cut are counted, never scored as wrong answers
    assert result["tag"] == "v1" and result["cut"] == 4 and result["acc"] == 1.0 and result["reward_mean"] == 1.0
    assert progress and progress[0] == {"tag": "v1", "done": 0, "total": 6, "reward_timeouts": 0}
    # the two hanging calls were killed with the pool; the two queued behind them never ran
    assert sorted(log.read_text().split()) == ["0", "1", "2", "3"]
