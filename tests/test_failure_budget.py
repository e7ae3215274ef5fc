"""The failure budget on its own: tries in the order they started, a share of a window, and the stop's one line."""

import random

from areal_hpc.workflow.failures import CANCELLED, SCORED, VOID, FailureBudget
from areal_hpc.workflow.records import EpisodeFailure

BOOM = EpisodeFailure("raised", "RuntimeError: the tool is down", "agents/flaky.py:12", "agent")
SLOW = EpisodeFailure("timed out", "it ran past workflow.agent_timeout_s=60 s", "", "agent")


def _start_up_burst(budget: FailureBudget, share: float, slots: int, rounds: int, seed: int) -> None:
    """`slots` episodes at once, as a generator runs them: a failing try comes back at once and runs again, a
    scoring one comes back only after every failure of its round (the slow path: the agent's turns)."""
    rng = random.Random(seed)
    for _ in range(rounds):
        running = [budget.start() for _ in range(slots)]
        scoring = []
        while running:  # failures first, in the same round: what ended lately is mostly failures
            again = []
            for seq in running:
                if rng.random() < share:
                    budget.end(seq, BOOM)
                    again.append(budget.start())
                else:
                    scoring.append(seq)
            running = again
        for seq in scoring:
            budget.end(seq, SCORED)


def test_a_flaky_tool_at_half_its_tries_never_spends_the_default_budget_even_at_start_up():
    for seed in range(5):
        budget = FailureBudget(0.75, 200)
        _start_up_burst(budget, 0.5, slots=256, rounds=20, seed=seed)
        assert budget.over is None, budget.over
        assert budget.by_kind["raised"] > 2000 and abs(budget.failed_recently / 200 - 0.5) < 0.2


def test_a_window_of_tries_that_ended_lately_would_have_tripped_on_the_same_burst():
    """Why the order of starts: the same burst judged by the last 200 tries to end is nearly all failures."""
    budget = FailureBudget(0.75, 200)
    ended = []
    budget.end = lambda seq, outcome: ended.append(outcome)  # the order they ended in, unsorted
    _start_up_burst(budget, 0.5, slots=256, rounds=1, seed=0)
    first = ended[:200]
    assert sum(o is BOOM for o in first) / len(first) > 0.75


def test_an_agent_that_always_fails_spends_it_in_one_line_naming_the_exception_and_the_counts():
    budget = FailureBudget(0.75, 200)
    for i in range(199):
        budget.end(budget.start(), SLOW if i % 10 == 0 else BOOM)
    assert budget.over is None  # the window is not full yet
    budget.end(budget.start(), BOOM)
    line = budget.over
    assert line is not None and "\n" not in line
    assert line.startswith("the agent raised: RuntimeError: the tool is down at agents/flaky.py:12; ")
    assert "200 of the last 200 episodes failed" in line
    assert "workflow.max_failure_share=0.75" in line and "workflow.failure_window=200" in line
    assert "(200 failed of 200 episodes on this generator: raised 180, timed out 20)" in line


def test_rejections_count_neither_way_and_hold_nothing_back():
    budget = FailureBudget(0.5, 4)
    first = budget.start()
    later = [budget.start() for _ in range(4)]
    for seq in later:
        budget.end(seq, BOOM)
    assert budget.over is None and not budget.recent  # waiting for the first try to end
    budget.end(first, VOID)  # rejected: it does not count
    assert budget.failed_recently == 4 and budget.over is not None and budget.episodes == 4


def test_a_stop_that_cuts_the_slow_successes_short_does_not_spend_the_budget():
    """At a stop the tries still running are cancelled: mostly successes in the making, as failures come back
    at once. Counting the ended tries around them would see a failure-rich window; a cancellation empties it."""
    budget = FailureBudget(0.75, 200)
    _start_up_burst(budget, 0.5, slots=256, rounds=5, seed=1)
    rng = random.Random(2)
    running = [budget.start() for _ in range(256)]
    for seq in running:  # the round the stop cuts: failures end, the rest are cancelled
        budget.end(seq, BOOM if rng.random() < 0.5 else CANCELLED)
    assert budget.over is None and len(budget.recent) < 200
    # the same round with the cut tries left out (VOID) would have counted only its failures
    naive = FailureBudget(0.75, 200)
    _start_up_burst(naive, 0.5, slots=256, rounds=5, seed=1)
    for seq in [naive.start() for _ in range(256)]:
        naive.end(seq, BOOM if rng.random() < 0.5 else VOID)
    assert naive.over is not None


def test_a_share_of_one_never_stops_the_run():
    budget = FailureBudget(1.0, 10)
    for _ in range(100):
        budget.end(budget.start(), BOOM)
    assert budget.over is None and budget.by_kind["raised"] == 100
