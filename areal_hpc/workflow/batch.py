"""The blocking call: run a batch of episodes on an engine with nothing else in flight (evaluation, the sync loop)."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass

from areal_hpc.engines.base import run_to_end
from areal_hpc.workflow.records import FinishedEpisode
from areal_hpc.workflow.runner import EpisodeRunner, RunnerSettings, Workflow

# a sample whose episode is rejected (returned None) this many times in a row stops the run: it would never finish
# (failures are not rejections: FailureBudget counts them)
MAX_REJECTED = 8


@dataclass
class EpisodeStart:
    key: Hashable  # unique in the batch
    row: dict
    prompt_ids: list[int]
    greedy: bool = False


def count_rejection(rejected: dict, key: Hashable, ep: FinishedEpisode, name: str | None = None) -> None:
    """A try of `key` came back without a reward and runs again: a rejection (not a failure) is counted in
    `rejected`, and RuntimeError stops the run at the MAX_REJECTED-th of one key (`name`: how the line says it).
    The one retry rule of the sync loop, evaluation and the generators."""
    if ep.failure is not None:  # FailureBudget counts failures
        return
    rejected[key] = rejected.get(key, 0) + 1
    if rejected[key] >= MAX_REJECTED:  # a workflow that rejects every try never ends
        raise RuntimeError(
            f"workflow.fn rejected {MAX_REJECTED} episodes in a row of {name or key} (it returned None each time); "
            "return a reward (0.0) for episodes that should count"
        )


def run_episodes(
    engine,
    workflow: Workflow,
    tokenizer,
    pool,
    settings: RunnerSettings,
    starts: list[EpisodeStart],
    retry=True,
) -> list[FinishedEpisode]:
    """Every episode to its end, in the order of `starts`; with `retry` a rejected or failed episode runs again
    (else it comes back with reward None, and its failure). Failures count against the runner's budget, which
    raises TooManyFailures. Between engine steps the episodes waiting on a reward or a tool go on."""
    runner = EpisodeRunner(workflow, tokenizer, pool, engine.add, settings, withdraw=engine.interrupt)
    by_key = {s.key: s for s in starts}
    if len(by_key) != len(starts):
        raise ValueError("run_episodes: episode keys must be unique")
    done: dict[Hashable, FinishedEpisode] = {}
    rejected: dict[Hashable, int] = {}
    carried: dict[Hashable, list] = {}  # the stats of each key's rejected tries

    def more() -> bool:
        """Start again what was rejected, keep what finished; False once every key has its episode."""
        finished = runner.poll(engine_idle=not (engine.num_running or engine.num_waiting))
        for ep in finished:
            if ep.reward is None and retry:
                carried.setdefault(ep.key, []).append(ep.stats)
                count_rejection(rejected, ep.key, ep)
                s = by_key[ep.key]
                runner.start(s.key, s.row, s.prompt_ids, s.greedy)
            else:
                done[ep.key] = ep
                for st in carried.pop(ep.key, []):  # a rejected try's failures count on the episode that ran
                    ep.stats.add_failures(st)
        return len(done) < len(starts)

    try:
        for s in starts:
            runner.start(s.key, s.row, s.prompt_ids, s.greedy)
        # the engine empty: every episode waits for a reward or a tool
        run_to_end(engine, runner.deliver, more, lambda: time.sleep(0.001))
    finally:
        # what episodes still have in the engine (on an error) leaves it
        left = runner.cancel()
        if left:
            engine.interrupt(left)
        runner.close()
    return [done[s.key] for s in starts]
