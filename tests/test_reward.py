"""Tests for areal_hpc.reward: math_reward equivalences, garbage safety, RewardPool behaviour."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from areal_hpc.reward import RewardPool, extract_last_boxed, math_reward
from areal_hpc.reward.bounds import bounded_call
from areal_hpc.reward.functions import MathAnswer

# ----------------------------------------------------------------- scorers run inside workers
# Top-level so they pickle by reference into the worker processes.


def _math_verify_loaded(completion: str, reference: str) -> float:
    import sys

    return float("math_verify" in sys.modules)


def _test_scorer(completion: str, reference: str) -> float:
    if completion.startswith("sleep:"):
        time.sleep(float(completion[6:]))
        return 1.0
    if completion == "hang":
        # Blocking SIGALRM defeats the in-worker soft timeout, like a hang inside C code.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
        return 1.0
    if completion == "crash":
        os._exit(3)
    return 1.0 if completion == reference else 0.0


def _affinity_mask(completion: str, reference: str) -> float:
    if completion == "crash":
        os._exit(3)
    return float(sum(1 << c for c in os.sched_getaffinity(0)))


def _slow(completion: str, reference: str) -> float:
    time.sleep(30)
    return 1.0


# ----------------------------------------------------------------- math_reward


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("\\boxed{0.5}", "1/2"),
        ("\\boxed{1/2}", "0.5"),
        ("\\boxed{42}", "42"),
        ("\\boxed{ 42 }", "42"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{0.5}", "\\dfrac{1}{2}"),
        ("\\boxed{-3}", "-3"),
        ("\\boxed{-\\frac{3}{4}}", "-0.75"),
        ("The answer is \\boxed{7}.", "7"),
        ("\\boxed{3}", "$\\boxed{3}$"),
        ("We get $x = 1$, so \\boxed{1} is wrong... fixing: \\boxed{2}", "2"),
        ("The final answer is $\\frac{1}{2}$", "0.5"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{3\\sqrt{2}}", "3\\sqrt{2}"),
        ("\\boxed{2} and then a dangling \\boxed{", "2"),
    ],
)
def test_equivalent_forms_score_one(completion, reference):
    assert math_reward(completion, reference) == 1.0


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("\\boxed{3}", "-3"),
        ("\\boxed{0.49}", "1/2"),
        ("\\boxed{1} then \\boxed{2}", "1"),  # the last boxed wins
        ("The answer is \\boxed{8}.", "7"),
        ("\\boxed{3\\sqrt{3}}", "3\\sqrt{2}"),
    ],
)
def test_wrong_answers_score_zero(completion, reference):
    assert math_reward(completion, reference) == 0.0


def _garbage() -> list[str]:
    rng = random.Random(0)
    rand_bytes = bytes(rng.randrange(256) for _ in range(3000)).decode("utf-8", errors="replace")
    return [
        "",
        "   ",
        rand_bytes,
        "\\boxed{",
        "\\boxed{{{",
        "}{}{\\boxed{{{",
        "\\boxed{}",
        "\\frac{" * 300,
        "\\boxed{" + "{" * 3000 + "}",
        "".join(rng.choice("{}\\$^_") for _ in range(100_000)),
        "x" * 100_000,
        "🙂🚀∑∫" * 500,
        "\ud800\udfff lone surrogates",
        "\x00\x01\x02",
    ]


def test_garbage_scores_zero_and_never_raises():
    for g in _garbage():
        assert math_reward(g, "42") == 0.0
        assert math_reward("\\boxed{42}", g) == 0.0
    assert math_reward(None, "1") == 0.0  # type: ignore[arg-type]
    assert math_reward("\\boxed{1}", None) == 0.0  # type: ignore[arg-type]
    assert math_reward("", "") == 0.0


def test_extract_last_boxed():
    assert extract_last_boxed("a \\boxed{1} b \\boxed{\\frac{2}{3}} c") == "\\frac{2}{3}"
    assert extract_last_boxed("\\boxed{5} \\boxed{") == "5"
    assert extract_last_boxed("no box") is None


def test_works_off_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join(30)
    assert out == [1.0]


def test_main_thread_timeout_and_caller_alarm_preserved():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        assert bounded_call(_slow, "a", "b", 0.2)[0] == 0.0  # _slow's own answer is 1.0: the limit ended it
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 20 < left <= 30  # the caller's own alarm is still armed
        assert signal.getsignal(signal.SIGALRM) is not None and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------- RewardPool


@pytest.fixture(scope="module")
def math_pool():
    # conftest imports torch first: the pool must work from such a process (no fork).
    with RewardPool(num_workers=2, timeout_s=5.0, scorer=MathAnswer()) as pool:
        yield pool


@pytest.fixture(scope="module")
def test_pool():
    with RewardPool(num_workers=2, timeout_s=0.5, scorer=_test_scorer, hard_grace_s=0.5) as pool:
        assert pool.warmup(timeout=60)
        yield pool


def test_pool_rewards_in_order(math_pool):
    n = 200
    completions = [f"Thus the result is \\boxed{{{i}}}." for i in range(n)]
    references = [str(i) if i % 3 else str(i + 1) for i in range(n)]
    expected = [1.0 if i % 3 else 0.0 for i in range(n)]
    assert math_pool.score(completions, references) == expected


def test_pool_garbage_and_empty(math_pool):
    garbage = _garbage()
    assert math_pool.score(garbage, ["42"] * len(garbage)) == [0.0] * len(garbage)
    assert math_pool.score([], []) == []
    with pytest.raises(ValueError):
        math_pool.submit(["a"], [])


def test_pool_works_from_thread(math_pool):
    out = []
    t = threading.Thread(target=lambda: out.append(math_pool.score(["\\boxed{2}"], ["2"])))
    t.start()
    t.join(60)
    assert out == [[1.0]]


def test_submit_is_non_blocking(test_pool):
    fut = test_pool.submit(["sleep:0.3", "sleep:0.3"], ["", ""])
    assert not fut.done()  # back before the scores (a blocking submit would return a done future)
    assert fut.result(timeout=30) == [1.0, 1.0]


def test_soft_timeout_scores_zero(test_pool):
    out = test_pool.score(["a", "sleep:30", "b"], ["a", "x", "b"])
    assert out == [1.0, 0.0, 1.0]  # "sleep:30" scores 1.0 once it wakes: 0.0 is the 0.5 s limit's


def test_hang_and_crash_score_zero_and_pool_recovers(test_pool):
    completions = ["a", "hang", "b", "crash", "c", "d"]
    references = ["a", "x", "b", "x", "c", "zz"]
    out = test_pool.submit(completions, references).result(timeout=90)
    assert out == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert test_pool.rebuilds >= 2
    assert test_pool.score(["ok"] * 5, ["ok"] * 5) == [1.0] * 5


def test_closed_pool_rejects_and_scorer_must_pickle():
    pool = RewardPool(num_workers=1, timeout_s=1.0, scorer=MathAnswer())
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError):
        pool.submit(["\\boxed{1}"], ["1"])
    with pytest.raises(ValueError):
        RewardPool(scorer=lambda c, r: 1.0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell them apart")
def test_pool_workers_run_on_the_cores_asked_for_also_after_a_rebuild():
    mine = os.sched_getaffinity(0)
    core = max(mine)
    with RewardPool(num_workers=1, timeout_s=2.0, scorer=_affinity_mask, cpus=frozenset({core})) as pool:
        assert pool.score(["a", "b"], ["", ""]) == [float(1 << core)] * 2
        assert pool.score(["crash"], [""]) == [0.0]
        assert pool.rebuilds >= 1 and pool.score(["c"], [""]) == [float(1 << core)]
    assert os.sched_getaffinity(0) == mine  # the caller stays where it was


def test_workers_load_only_what_their_scorer_uses():
    """A worker warms up its own scorer (its load()), not math-verify for every reward: a code or user reward's
    workers never import it, the math reward's have it loaded before the first call's time limit starts."""
    with RewardPool(num_workers=1, scorer=_math_verify_loaded) as pool:
        assert pool.warmup(120) and pool.score(["a"], [""]) == [0.0]
    from areal_hpc.reward.functions import UserReward, WeightedRewards

    mixed = WeightedRewards(("math", "mine"), (MathAnswer(), UserReward(f"{__name__}:_math_verify_loaded")), (0, 1))
    with RewardPool(num_workers=1, scorer=mixed) as pool:
        assert pool.warmup(120) and pool.score(["a"], ["1"]) == [1.0]


LEAVE_AT_ONCE = r"""
import os
import sys

from areal_hpc.reward import RewardPool
from areal_hpc.reward.functions import MathAnswer

pool = RewardPool(num_workers=2, timeout_s=5.0, scorer=MathAnswer())
assert pool.score(["\\boxed{2}"], ["2"]) == [1.0]
pool.close(finish_queued=False)  # as a generator rank closes it
sys.stderr.flush()
os._exit(0)  # as the rank then leaves (runtime/worker.py's exit_rank): no finalizer runs
"""


def test_a_pool_closed_without_finishing_leaves_no_semaphores_to_a_process_that_exits_at_once():
    """The workers' queues and counter are named semaphores, unlinked only when freed: a pool whose queues were
    still held at os._exit left the resource tracker to warn of 5 leaked semaphores in every generator's log."""
    r = subprocess.run([sys.executable, "-c", LEAVE_AT_ONCE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "leaked semaphore" not in r.stderr, r.stderr  # the tracker writes it to this stderr, before EOF
