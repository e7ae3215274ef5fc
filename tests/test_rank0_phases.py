"""Rank 0's phases and checkpoint rounds, without MPI: the stop sequence as the Scheduler's tick drives it."""

from __future__ import annotations

from areal_hpc.runtime.rank0.phases import CheckpointRound, Phase, StopSequence


def _phases():
    return StopSequence(other_ranks=[1, 2, 3], generator_ranks=[2, 3])  # rank 1 trains, ranks 2 and 3 generate


def test_a_run_that_ends_by_itself_goes_through_every_phase_in_order():
    p = _phases()
    assert p.phase is Phase.STARTING
    p.started()
    assert p.phase is Phase.RUNNING
    assert p.stop("trained 10 versions") and p.phase is Phase.STOPPING
    assert not p.stop("wall-time limit") and p.reason == "trained 10 versions"  # the first reason stays
    assert p.final_eval_budget(30.0) is None  # no request: the final evaluation is not bounded by stop_eval_s
    p.checkpointed(eval_asked=True)
    assert p.phase is Phase.FINAL_EVAL
    p.said_bye(1)
    assert p.phase is Phase.FINAL_EVAL
    p.final_eval_ended()
    assert p.phase is Phase.DRAINING
    p.said_bye(3)
    p.said_bye(2)
    assert p.phase is Phase.DONE and p.done


def test_a_stop_request_bounds_the_final_evaluation_and_one_during_it_cuts_it():
    asked = _phases()
    asked.started()
    asked.stop("stop requested", requested=True)
    assert asked.final_eval_budget(30.0) == 30.0
    asked.checkpointed(eval_asked=True)
    assert asked.cut_final_eval() == []  # already bounded by its request

    ended = _phases()
    ended.started()
    ended.stop("trained 10 versions")
    ended.checkpointed(eval_asked=True)
    ended.said_bye(3)
    assert ended.cut_final_eval() == [2]  # the generators that have not said BYE
    assert ended.cut_final_eval() == []  # once
    ended.said_bye(2)  # the evaluator's BYE ends its evaluation, whether or not a result came
    assert ended.phase is Phase.DRAINING
    ended.said_bye(1)
    assert ended.done


def test_no_final_evaluation_goes_straight_to_draining_and_a_stop_during_start_up_stays_a_stop():
    p = _phases()
    p.stop("stop requested", requested=True)
    p.started()  # trainer 0's READY after the request: still stopping
    assert p.phase is Phase.STOPPING
    assert p.cut_final_eval() == []
    p.checkpointed(eval_asked=False)
    assert p.phase is Phase.DRAINING
    for r in (1, 2, 3):
        assert not p.done
        p.said_bye(r)
    assert p.done


def test_a_run_with_no_other_rank_is_done_once_checkpointed():
    p = StopSequence(other_ranks=[], generator_ranks=[])
    p.started()
    p.stop("trained 1 versions")
    p.checkpointed(eval_asked=False)
    assert p.done


def test_a_checkpoint_round_completes_once_every_trainer_answered():
    ck = CheckpointRound(n_trainers=2)
    assert ck.begin(4, now=10.0)
    assert not ck.begin(5, now=11.0)  # one round at a time
    assert ck.trainer_done() is None
    assert ck.trainer_done() == 4
    assert not ck.holds(4)  # rank 0's state is not written yet
    assert ck.complete(now=13.5) == 3.5
    assert ck.holds(4) and not ck.holds(5)
    assert not ck.begin(4, now=14.0)  # never the same version twice


def test_version_rows_leave_in_order_once_trained_and_every_awaited_part_is_in():
    from areal_hpc.runtime.reporting.version_rows import VersionRows

    rows = VersionRows(n_generators=1)
    for v in (1, 2):
        rows.add(v, {})
        rows.expect(v, {"sync", "load2"})
    rows.part_arrived(2, "train", {"loss": 0.5})
    rows.part_arrived(2, "sync", {"checksum_trainer": "ab"})
    rows.part_arrived(2, "load2", {"checksum_gen0": "ab"})
    assert rows.take_complete() == []  # version 1 comes first
    assert rows.trained_rows(upto=2) == {"2": {"loss": 0.5, "checksum_trainer": "ab", "checksum_gen0": "ab"}}
    rows.part_arrived(1, "train")
    rows.part_arrived(1, "sync")
    assert rows.take_complete() == []  # still waits for generator 2's load
    rows.part_arrived(1, "load2")
    out = rows.take_complete()
    assert [v for v, _ in out] == [1, 2] and out[1][1]["weights_match"] == 1
    rows.add(3, {})
    rows.expect(3, {"sync"})
    assert [v for v, _ in rows.take_complete(force=True)] == [3]  # the run's end writes what it has


def test_the_prompt_count_reads_the_rows_without_a_tokenizer_unless_a_length_limit_needs_it(tmp_path, tiny_model_dir):
    import json

    from areal_hpc.config import load_config
    from areal_hpc.data import load_run_dataset
    from areal_hpc.model import load_tokenizer
    from areal_hpc.runtime.rank0.prompt_count import count_train_prompts

    path = tmp_path / "rows.jsonl"
    rows = [{"question": "1+1=" * (1 + i % 7), "answer": "2"} for i in range(40)] + [{"question": "no answer"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    base = [f"model.path={tmp_path / 'absent'}", "data.kind=jsonl", f"data.path={path}", "data.heldout_size=5"]
    assert count_train_prompts(load_config(None, base)) == 35  # no model folder: the tokenizer is never loaded
    for limit in (0, 12):
        cfg = load_config(None, [*base, f"model.path={tiny_model_dir}", f"data.max_prompt_tokens={limit}"])
        expected = len(load_run_dataset(cfg, load_tokenizer(tiny_model_dir)).train)
        assert count_train_prompts(cfg) == expected
