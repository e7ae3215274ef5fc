"""The scheduler's pure core: admission, oldest-first batches, stale drops, balance, checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from areal_hpc.runtime.rank0.scheduler_core import ReadyGroup, SchedulerCore, fair_shares


def _group(i, version_start, n_tokens=10):
    return ReadyGroup(
        shard=f"g000-{i:08d}.h5",
        indices=list(range(4)),
        prompt_id=i,
        group_id=i,
        n_tokens=n_tokens,
        version_start=version_start,
    )


def test_grants_follow_the_staleness_rule_and_cover_the_dataset():
    core = SchedulerCore(n_prompts=10, batch_prompts=4, eta=1)
    first = core.grant(100)
    assert len(first) == 8  # (0 + 1 + 1) * 4
    assert core.grant(1) == []
    for p in first[:4]:
        core.group_done(_group(p, 0))
    plan = core.next_batch()
    assert plan is not None and [g.prompt_id for g in plan.groups] == first[:4]  # oldest first
    core.version_trained(1)
    more = core.grant(100)
    assert len(more) == 4
    # the first epoch visits every prompt once before any repeats
    assert sorted(first + more[:2]) == list(range(10))


def test_too_stale_groups_are_dropped_and_their_slots_returned():
    core = SchedulerCore(n_prompts=100, batch_prompts=2, eta=1)
    core.grant(4)
    core.group_done(_group(0, version_start=0))
    for v in (1, 2):  # two versions pass while that group waits
        core.version_trained(v)
    core.group_done(_group(1, version_start=2))
    core.group_done(_group(2, version_start=1))
    plan = core.next_batch()
    assert [g.prompt_id for g in plan.groups] == [2, 1]  # ordered by oldest version, not by arrival
    assert core.dropped_stale == 1
    for g in plan.groups:
        assert plan.version - g.version_start <= core.eta
    assert core.gate.accepted == 2  # the dropped group gave its slot back


def test_shares_are_balanced_by_tokens():
    core = SchedulerCore(n_prompts=100, batch_prompts=6, eta=0, n_trainers=2)
    core.grant(6)
    for i, n in enumerate([100, 90, 10, 10, 5, 5]):
        core.group_done(_group(i, 0, n))
    plan = core.next_batch()
    loads = [sum(plan.groups[i].n_tokens for mb in s for i in mb) for s in plan.shares]
    assert sorted(i for s in plan.shares for mb in s for i in mb) == list(range(6))
    assert abs(loads[0] - loads[1]) <= 20
    assert len(plan.entries()) == 24


def test_minibatches_do_not_depend_on_the_number_of_trainers():
    def plan_for(n_trainers):
        core = SchedulerCore(n_prompts=100, batch_prompts=8, eta=0, n_trainers=n_trainers, n_minibatches=2)
        core.grant(8)
        for i, n in enumerate([40, 35, 30, 22, 20, 12, 9, 5]):
            core.group_done(_group(i, 0, n))
        return core.next_batch()

    one, two = plan_for(1), plan_for(2)
    assert all(len(s) == 2 for s in two.shares)  # every trainer gets every minibatch (maybe empty)
    for j in range(2):  # minibatch j is the same set of groups, however many trainers share it
        assert sorted(one.shares[0][j]) == sorted(two.shares[0][j] + two.shares[1][j])


def test_checkpoint_round_trip_is_json_and_resumes_the_cursor():
    core = SchedulerCore(n_prompts=50, batch_prompts=3, eta=2, seed=7)
    granted = core.grant(7)
    for p in granted[:5]:
        core.group_done(_group(p, 0))
    core.next_batch()
    state = json.loads(json.dumps(core.state_dict()))
    again = SchedulerCore(n_prompts=50, batch_prompts=3, eta=2, seed=7)
    again.load_state_dict(state)
    assert again.cursor == core.cursor and len(again.ready) == 2
    assert again.gate.running == 0  # prompts in flight at the crash are gone
    assert again.grant(1) == core.grant(1)  # same next prompt


def test_random_run_respects_bound_and_consumes_each_group_once():
    rng = np.random.default_rng(0)
    core = SchedulerCore(n_prompts=40, batch_prompts=4, eta=2, n_trainers=2)
    running, seen, group_id = [], set(), 0
    for _ in range(2000):
        for p in core.grant(int(rng.integers(0, 3))):
            running.append((group_id, p, core.version))
            group_id += 1
        if running and rng.random() < 0.5:
            gid, p, v0 = running.pop(int(rng.integers(len(running))))  # finish in any order
            core.group_done(_group(gid, v0))
        plan = core.next_batch()
        if plan:
            for g in plan.groups:
                assert plan.version - g.version_start <= 2
                assert g.group_id not in seen
                seen.add(g.group_id)
            core.version_trained(plan.version + 1)
    assert core.version > 50


def test_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="at least one training prompt"):
        SchedulerCore(n_prompts=0, batch_prompts=1, eta=0)


def test_a_late_old_group_is_not_overtaken():
    core = SchedulerCore(n_prompts=100, batch_prompts=2, eta=2)
    core.grant(6)
    core.version_trained(1)
    for i, v in enumerate([1, 1, 0]):  # the version-0 group finishes last
        core.group_done(_group(i, v))
    plan = core.next_batch()
    assert [g.prompt_id for g in plan.groups] == [2, 0]  # it goes first, then arrival order within a version
    assert [g.prompt_id for g in core.ready] == [1]


def test_uniform_groups_are_rejected_and_refilled():
    core = SchedulerCore(n_prompts=100, batch_prompts=2, eta=0, reject_uniform=True)
    assert len(core.grant(10)) == 2
    assert core.group_done(_group(0, 0), uniform=True) is False
    assert core.gate.running == 1 and core.gate.accepted == 0 and core.rejected == 1
    assert len(core.grant(10)) == 1  # the rejected group's slot is granted again
    core.group_done(_group(1, 0))
    assert core.next_batch() is None  # one informative group is not a batch
    core.group_done(_group(2, 0))
    plan = core.next_batch()
    assert [g.prompt_id for g in plan.groups] == [1, 2]
    state = json.loads(json.dumps(core.state_dict()))
    again = SchedulerCore(n_prompts=100, batch_prompts=2, eta=0, reject_uniform=True)
    again.load_state_dict(state)
    assert again.rejected == 1
    # without rejection a uniform group is an ordinary ready group
    keep = SchedulerCore(n_prompts=100, batch_prompts=1, eta=0)
    keep.grant(1)
    assert keep.group_done(_group(0, 0), uniform=True) and keep.next_batch() is not None


def test_fair_shares_follow_free_capacity_not_rank_order():
    assert fair_shares({1: 3, 2: 5}, 100) == {1: 3, 2: 5}  # enough for everyone
    assert fair_shares({1: 10, 2: 30}, 8) == {1: 2, 2: 6}  # proportional to what each asked for
    assert fair_shares({1: 4, 2: 4}, 1) == {1: 1, 2: 0}
    assert fair_shares({1: 3, 2: 4}, 1) == {1: 0, 2: 1}  # the one with more free room first
    shares = fair_shares({1: 7, 2: 0, 3: 7, 4: 7}, 10)
    assert sum(shares.values()) == 10 and max(shares.values()) - min(shares.values()) <= 1 and 2 not in shares


def test_restore_reuses_fresh_stored_groups_and_drops_the_rest():
    core = SchedulerCore(n_prompts=50, batch_prompts=2, eta=1, seed=3)
    core.grant(4)
    state = json.loads(json.dumps(core.state_dict()))  # a checkpoint at version 0, 4 prompts in flight
    # what the store holds after a crash at version 3 that rolled back to 3: (group, newest token version)
    stored = [
        (_group(10, version_start=2), 3),  # fresh for v3 and sampled by kept versions: reused
        (_group(11, version_start=1), 2),  # 3 - 1 > eta: too stale
        (_group(12, version_start=3), 4),  # has tokens of version 4, which the resume rolled back
        (_group(13, version_start=3), 3),  # reused
    ]
    fresh = SchedulerCore(n_prompts=50, batch_prompts=2, eta=1, seed=3)
    assert fresh.restore(3, state, stored) == (2, 2)
    assert fresh.version == 3 and fresh.cursor == 4
    assert [g.group_id for g in fresh.ready] == [10, 13] and sorted(fresh.dropped_ids) == [11, 12]
    # 3 trained versions x B plus the two reused groups count as accepted; nothing is running any more
    assert fresh.gate.accepted == 3 * 2 + 2 and fresh.gate.running == 0
    assert fresh.gate.capacity() == (3 + 1 + 1) * 2 - 8
    plan = fresh.next_batch()
    assert plan is not None and plan.version == 3 and [g.group_id for g in plan.groups] == [10, 13]
    # a group dropped before the checkpoint is not brought back by a later restore
    again = SchedulerCore(n_prompts=50, batch_prompts=2, eta=1, seed=3)
    assert again.restore(3, fresh.state_dict(), [(_group(11, 1), 2)]) == (0, 0)
