"""The generator's bookkeeping on its own: admission, the group book, shard flushing (no MPI, no engine)."""

import pytest

from areal_hpc.data import Problem
from areal_hpc.runtime.generation.generator_core import Admission, GeneratorCore, GroupBook, ShardBuffer
from areal_hpc.types import EvalId, GenRequest, RequestId, SampleId
from areal_hpc.workflow import FinishedEpisode
from areal_hpc.workflow.batch import MAX_REJECTED
from areal_hpc.workflow.records import EpisodeFailure, EpisodeStats, Segment

N = 4  # samples per group


def _core(capacity=8, max_groups=10, shard_groups=3, wait_s=5.0) -> GeneratorCore:
    return GeneratorCore(
        Admission(N, capacity, max_groups), GroupBook(N, gen_rank=2), ShardBuffer(shard_groups, wait_s, seq=7)
    )


def _problem(pid: int) -> Problem:
    return Problem(pid, "q", "a", prompt_ids=[1, 2, 3], row={"q": pid}, row_index=10 + pid)


def _episode(key: SampleId, reward: float | None, n_out: int = 2, t_end: float = 20.0) -> FinishedEpisode:
    tools = [(12.0, 13.0)] if key.sample == 0 else []
    stats = EpisodeStats(turns=1 + key.sample, reward_span=(15.0, t_end), tool_spans=tools)
    segments = [Segment([1, 2, 3], False), Segment([5] * n_out, True, [-0.5] * n_out, [3] * n_out)]
    return FinishedEpisode(key, reward, segments, stats, "stop", 11.0, t_end)


def _req(rid) -> GenRequest:
    return GenRequest(rid, [1, 2, 3], 8)


def test_admission_fills_the_engine_with_one_group_beyond_its_slots_and_bounds_groups_in_flight():
    core = _core(capacity=8, max_groups=10)
    assert core.want(0, ready=False) == 0  # no weights yet, or a drain load waiting
    assert core.want(0, ready=True) == 3  # 8 slots + one group of 4 queued beyond them
    assert core.want(0, ready=True) == 0  # asked and not granted counts as load
    core.grant([(0, _problem(0)), (1, _problem(1)), (2, _problem(2))], now=1.0)
    assert core.admission.asked == 0
    assert core.want(12, ready=True) == 0
    assert core.want(5, ready=True) == 2  # 7 sequences finished: ceil((8 + 4 - 5) / 4)
    core.submit([_req(RequestId(SampleId(g, 0), g)) for g in range(8)], admitting=True)
    assert core.want(0, ready=True) == 0  # 8 groups on the engine + 2 asked of max 10
    core.stop()
    assert core.want(0, ready=True) == 0


def test_requests_held_during_a_weight_load_count_as_load_and_reach_the_engine_after_it():
    core = _core(capacity=4, max_groups=10)
    reqs = [_req(RequestId(SampleId(0, s), s)) for s in range(N)]
    assert core.submit(reqs[:2], admitting=True) == reqs[:2]
    assert core.submit(reqs[2:], admitting=False) == []
    assert core.held == reqs[2:]
    assert core.want(2, ready=True) == 1  # 2 in the engine + 2 held: ceil((4 + 4 - 4) / 4)
    core.left([reqs[3].request_id])  # cancelled while held
    assert core.release() == [reqs[2]] and core.held == []


def test_the_book_counts_a_groups_requests_on_the_engine_by_typed_id():
    book = GroupBook(N, gen_rank=0)
    a, b = RequestId(SampleId(5, 0), 0), RequestId(SampleId(5, 1), 1)
    book.entered([a, b, RequestId(EvalId(3), 2), "not-a-runner-id"])
    assert book.on_engine == {5: {a, b}}  # evaluations hold no training group's slot
    book.left([a, a, RequestId(SampleId(9, 0), 4)])  # unknown or twice: no change beyond the one
    assert book.on_engine == {5: {b}}
    book.left([b])
    assert book.on_engine == {}


def test_a_group_ends_with_its_last_episode_as_spans_and_records_in_sample_order():
    book = GroupBook(N, gen_rank=2)
    keys = book.grant(4, _problem(9), now=10.0)
    assert keys == [SampleId(4, s) for s in range(N)]
    for s in (2, 0, 3):
        assert book.ended(SampleId(4, s), _episode(SampleId(4, s), float(s), t_end=20.0 + s)) is None
    spans, (trajs, episodes, summary) = book.ended(SampleId(4, 1), _episode(SampleId(4, 1), 1.0, t_end=21.0))
    assert spans == [("group", 10.0, 23.0), ("reward", 15.0, 23.0), ("tool", 12.0, 13.0)]
    assert [t.sample_idx for t in trajs] == [0, 1, 2, 3] and [t.reward for t in trajs] == [0.0, 1.0, 2.0, 3.0]
    assert {(t.group_id, t.prompt_id, t.gen_rank, t.row_index) for t in trajs} == {(4, 9, 2, 19)}
    assert [(e.group_id, e.sample_idx, e.turns) for e in episodes] == [(4, s, 1 + s) for s in range(N)]
    assert summary["group_id"] == 4 and summary["episodes"] == N and summary["uniform"] is None
    assert 4 not in book.running


def test_a_rejected_episode_runs_again_until_it_is_rejected_too_often():
    book = GroupBook(1, gen_rank=0)
    p = _problem(3)
    book.grant(0, p, now=0.0)
    key = SampleId(0, 0)
    for _ in range(MAX_REJECTED - 1):
        assert book.rejected(key, _episode(key, None)) is p
    with pytest.raises(RuntimeError, match="rejected 8 episodes in a row of prompt 3"):
        book.rejected(key, _episode(key, None))


def test_a_failed_episode_runs_again_however_often_and_its_failures_count_by_kind():
    """Failures are not rejections: the in-a-row limit is for a workflow returning None, the budget for failures."""
    book = GroupBook(1, gen_rank=0)
    p = _problem(3)
    book.grant(0, p, now=0.0)
    key = SampleId(0, 0)
    for _ in range(3 * MAX_REJECTED):
        failed = _episode(key, None)
        failed.failure = EpisodeFailure("raised", "RuntimeError: x", "agent.py:3", "agent")
        failed.stats.add_failure(failed.failure)
        assert book.rejected(key, failed) is p
    _, (_, _, summary) = book.ended(key, _episode(key, 1.0))
    assert summary["agent_failures"] == 3 * MAX_REJECTED and summary["failure_kinds"] == {"raised": 24}


def test_a_rejected_episodes_failures_count_on_its_group():
    book = GroupBook(1, gen_rank=0)
    book.grant(0, _problem(3), now=0.0)
    key = SampleId(0, 0)
    bad = _episode(key, None)
    bad.stats.reward_errors = 2
    book.rejected(key, bad)
    _, (_, _, summary) = book.ended(key, _episode(key, 1.0))
    assert summary["reward_errors"] == 2 and summary["episodes"] == 1


def test_episodes_of_a_dropped_group_are_ignored():
    core = _core()
    core.grant([(1, _problem(1))], now=0.0)
    core.submit([_req(RequestId(SampleId(1, 0), 0))], admitting=True)
    core.stop()
    assert core.book.running == {} and core.book.on_engine == {}
    assert core.book.ended(SampleId(1, 0), _episode(SampleId(1, 0), 1.0)) is None
    assert core.book.rejected(SampleId(1, 0), _episode(SampleId(1, 0), None)) is None
    assert core.done  # stopped with nothing scored


def _scored(core: GeneratorCore, gid: int, now: float) -> None:
    core.book.grant(gid, _problem(gid), now)
    for s in range(N):
        ended = core.book.ended(SampleId(gid, s), _episode(SampleId(gid, s), float(s), n_out=1 + s))
    core.shards.add(ended[1], now)


def test_a_shard_is_due_at_max_groups_max_wait_or_when_nothing_else_is_coming():
    core = _core(shard_groups=3, wait_s=5.0)
    core.book.grant(99, _problem(0), now=0.0)  # still running: more is coming
    assert core.flush(0.0) is None  # nothing scored
    _scored(core, 0, now=1.0)
    _scored(core, 1, now=2.0)
    assert core.flush(5.9) is None  # 2 of 3 groups, the oldest waited 4.9 s
    assert core.flush(6.0) is not None  # the oldest waited 5 s
    _scored(core, 2, now=7.0)
    _scored(core, 3, now=7.0)
    _scored(core, 4, now=7.0)
    assert core.flush(7.0) is not None  # 3 groups
    _scored(core, 5, now=8.0)
    assert core.flush(8.0) is None
    core.book.running.pop(99)
    assert core.flush(8.0) is not None  # no group of this generator is running


def test_a_shard_numbers_its_groups_trajectories_and_takes_the_next_sequence_number():
    core = _core(shard_groups=2)
    _scored(core, 0, now=1.0)
    _scored(core, 1, now=1.0)
    trajs, episodes, summaries, seq = core.flush(1.0)
    assert seq == 7 and core.shards.seq == 8 and core.shards.scored == []
    assert [s["indices"] for s in summaries] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [(t.group_id, t.sample_idx) for t in trajs] == [(g, s) for g in (0, 1) for s in range(N)]
    assert [(e.group_id, e.sample_idx) for e in episodes] == [(g, s) for g in (0, 1) for s in range(N)]
    assert [len(t.input_ids) for t in trajs[:N]] == [4, 5, 6, 7]


def test_a_stopping_generator_writes_what_is_scored_and_is_then_done():
    core = _core(shard_groups=10, wait_s=100.0)
    core.book.grant(99, _problem(0), now=0.0)
    _scored(core, 0, now=1.0)
    core.stop()
    assert not core.done
    _, _, summaries, _ = core.flush(1.0)
    assert [s["group_id"] for s in summaries] == [0] and core.done
