"""One home each: the prompt order, the rejection retry, the start-up check list and the workflow's key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, load_config
from areal_hpc.data.order import PromptOrder, batch_draws, epoch_order
from areal_hpc.runtime.rank0.scheduler_core import SchedulerCore
from areal_hpc.workflow.batch import MAX_REJECTED, count_rejection
from areal_hpc.workflow.records import EpisodeFailure

PACKAGE = Path(__file__).resolve().parents[1] / "areal_hpc"


def test_the_sync_loop_and_rank_0_draw_the_same_prompts_across_epochs():
    n, b, seed = 7, 3, 11
    core = SchedulerCore(n_prompts=n, batch_prompts=b, eta=100, seed=seed)
    granted = []
    while len(granted) < 5 * n:  # five epochs, granted in uneven bites as generators ask
        granted += core.grant(1 + len(granted) % 4)
    order = PromptOrder(n, seed)
    drawn = [i for v in range(1, len(granted) // b + 1) for i in batch_draws(order, v, b)]
    assert granted[: len(drawn)] == drawn
    epochs = [granted[e * n : (e + 1) * n] for e in range(5)]
    assert all(sorted(e) == list(range(n)) for e in epochs)  # each epoch draws every prompt once
    assert epochs[0] != epochs[1] and epochs[1] == epoch_order(n, seed, 1)  # a fresh shuffle per epoch


class _Ended:
    def __init__(self, failure=None):
        self.failure = failure


def test_rejections_stop_the_run_at_the_limit_and_failures_do_not_count():
    rejected: dict = {}
    for _ in range(3 * MAX_REJECTED):  # failures are the failure budget's business
        count_rejection(rejected, "k", _Ended(EpisodeFailure("raised", "boom")))
    for _ in range(MAX_REJECTED - 1):
        count_rejection(rejected, "k", _Ended())
    with pytest.raises(RuntimeError, match=f"rejected {MAX_REJECTED} episodes in a row of prompt 3"):
        count_rejection(rejected, "k", _Ended(), "prompt 3")


def test_rollout_workflow_is_workflow_fn_under_its_old_name(capsys, tmp_path):
    assert load_config(None, ["model.path=/m", "rollout.workflow=tool"]).workflow.fn == "tool"
    assert "rollout.workflow=tool is deprecated; it means workflow.fn=tool" in capsys.readouterr().err
    said_later = load_config(None, ["model.path=/m", "rollout.workflow=tool", "workflow.fn=multi_turn"])
    assert said_later.workflow.fn == "multi_turn"
    both = tmp_path / "both.yaml"
    both.write_text("model: {path: /m}\nrollout: {workflow: tool}\nworkflow: {fn: single_turn}\n")
    with pytest.raises(ConfigError, match="contradicts workflow.fn"):
        load_config(both)


def test_every_start_runs_the_one_check_list():
    """The launchers and the sync loop call check_start; none runs a check of the list on its own."""
    own = ("check_user_code(", "check_warm_start(", "model_mismatch(", "teacher_mismatch(", "check_model_fits(")
    for path in ("launch/local.py", "launch/slurm.py", "runtime/sync_loop.py"):
        text = (PACKAGE / path).read_text()
        assert re.search(r"\bcheck_start\(", text), path
        assert not [c for c in own if c in text], path
