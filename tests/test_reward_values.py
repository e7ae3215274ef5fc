"""Rewards that say what went wrong: values that are not rewards, extras, reward.args and weighted lists, through
the real RewardPool; the bad reward configs; rank 0's count of every generated episode."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from areal_hpc.config import load_config
from areal_hpc.config.errors import ConfigError
from areal_hpc.episode_counts import group_counts
from areal_hpc.plugins import PluginError
from areal_hpc.reward import reward_pool_for
from areal_hpc.runtime.reporting.generated import GeneratedEpisodes
from areal_hpc.workflow.records import EpisodeStats

ROOT = Path(__file__).resolve().parents[1]

USER = """
import math


def reward(completion, row, bonus=0.0):
    values = {
        "none": None,
        "nan": math.nan,
        "inf": -math.inf,
        "text": "1.0",
        "extras": {"score": 0.5, "length": len(row["q"]), "exact": True},
        "no_score": {"length": 3.0},
        "bad_extra": {"score": 1.0, "note": "close"},
    }
    if completion == "raise":
        raise KeyError("no_such_field")
    return values.get(completion, 1.0 + bonus)


def form(completion, row):
    return {"score": float(completion.startswith("ok")), "chars": len(completion)}
"""


def _cfg(tmp_path, *overrides):
    f = tmp_path / "user_reward.py"
    f.write_text(USER)
    base = ["model.path=/m", "reward.num_workers=1", "reward.timeout_s=5"]
    return load_config(None, base + [o.format(f=f) for o in overrides])


def test_a_reward_that_is_not_a_number_is_an_error_counted_and_logged_once_with_its_type(tmp_path, caplog):
    cfg = _cfg(tmp_path, "reward.fn={f}:reward")
    texts = ["none", "nan", "inf", "text", "extras", "no_score", "bad_extra", "raise", "ok", "none", "text"]
    with caplog.at_level(logging.WARNING, "areal_hpc.reward.pool"), reward_pool_for(cfg) as pool:
        scores = pool.submit(texts, [{"q": "12+7="}] * len(texts)).result(timeout=120)
    assert list(scores) == [0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    ok = {4, 8}
    assert [s == "ok" for s in scores.statuses] == [i in ok for i in range(len(texts))]
    assert scores.errors == len(texts) - 2 and scores.timeouts == 0
    # the numbers a dict carries beside its score come back with it (True is a number: 1.0)
    assert scores.extras[4] == {"length": 5.0, "exact": 1.0}
    assert all(e == {} for i, e in enumerate(scores.extras) if i != 4)
    # the first value that is not a reward is logged with its type and repr, the first exception too; no more
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "returned None (NoneType)" in lines[0] and "finite 'score'" in lines[0]
    assert "raised KeyError: 'no_such_field'" in lines[1]


def test_reward_args_are_keyword_arguments_and_a_list_is_a_logged_weighted_sum(tmp_path, caplog):
    cfg = _cfg(tmp_path, "reward.fn={f}:reward", "reward.args={{bonus: 0.25}}")
    with reward_pool_for(cfg) as pool:
        assert list(pool.submit(["right"], [{"q": "x"}]).result(timeout=120)) == [1.25]
    cfg = _cfg(tmp_path, "reward.fn=[{f}:reward,{f}:form]", "reward.weights=[1.0,2.0]", "reward.args={{bonus: 1}}")
    with caplog.at_level(logging.WARNING, "areal_hpc.reward.pool"), reward_pool_for(cfg) as pool:
        s = pool.submit(["ok", "nope", "none", "raise"], [{"q": "x"}] * 4).result(timeout=120)
    assert list(s) == [2.0 + 2.0 * 1.0, 2.0 + 0.0, 0.0, 0.0]
    assert s.extras[0] == {"reward": 2.0, "form": 1.0, "form/chars": 2.0}
    assert s.extras[1] == {"reward": 2.0, "form": 0.0, "form/chars": 4.0}
    # one function of the list returned None, or raised: the call is an error, and the log names the function
    assert s.statuses == ["ok", "ok", "error", "error"]
    lines = [r.getMessage() for r in caplog.records]
    assert any("reward returned None" in ln for ln in lines), lines
    assert any("reward raised KeyError: 'no_such_field'" in ln for ln in lines), lines
    # with no weights every function counts once; a built-in can be one of them
    cfg = _cfg(tmp_path, "reward.fn=[math,{f}:form]", "data.answer_key=answer")
    with reward_pool_for(cfg) as pool:
        s = pool.submit(["ok \\boxed{19}"], [{"answer": "19"}]).result(timeout=120)
    assert list(s) == [2.0] and s.extras[0] == {"math": 1.0, "form": 1.0, "form/chars": 13.0}


def test_the_documented_weighted_list_of_the_example_rewards_scores_as_it_says(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    f = "jobs/examples/my_reward.py"
    overrides = [f"reward.fn=[{f}:reward,{f}:form]", "reward.weights=[1.0,0.2]", "reward.args={wrong: 0.0}"]
    cfg = load_config(ROOT / "jobs" / "examples" / "custom.yaml", ["model.path=/m", *overrides])
    with reward_pool_for(cfg) as pool:
        s = pool.submit(["\\boxed{19}", "\\boxed{18}", "19"], [{"answer": 19}] * 3).result(timeout=120)
    assert list(s) == pytest.approx([1.2, 0.2, 0.0]) and s.statuses == ["ok"] * 3
    assert s.extras[0] == {"reward": 1.0, "form": 1.0, "form/length": 10.0}


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["reward.fn={f}:reward", "reward.weights=[1.0]"], "reward.weights=[1.0] needs reward.fn as a list"),
        (["reward.fn=[{f}:reward,{f}:form]", "reward.weights=[1.0]"], "lists 1 weights but reward.fn lists 2"),
        (["reward.fn=[{f}:reward,{f}:form]", "reward.weights=[1.0,heavy]"], "reward.weights[1]='heavy' must be"),
        (["reward.fn=[]"], "reward.fn=[] must be a function"),
        (["reward.fn=[{f}:reward,nonsense]"], "reward.fn[1]='nonsense' is neither a built-in"),
        (["reward.fn=[{f}:reward,{f}:reward]"], "two functions named 'reward'"),
        (["reward.args={{bonus: 1}}"], "reward.args reaches reward functions of your own"),
    ],
)
def test_bad_reward_lists_stop_at_config_load_in_one_line(tmp_path, overrides, words):
    with pytest.raises(ConfigError, match="^config ") as err:
        _cfg(tmp_path, *overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_reward_args_a_function_cannot_take_stop_before_the_pool_starts(tmp_path):
    cfg = _cfg(tmp_path, "reward.fn={f}:reward", "reward.args={{bonus: 1, scale: 2}}")
    with pytest.raises(PluginError, match=r"cannot be called as f\(completion, row, bonus=..., scale=...\)"):
        reward_pool_for(cfg)
    # in a list each function gets the arguments it takes; one that none takes is refused
    cfg = _cfg(tmp_path, "reward.fn=[{f}:reward,{f}:form]", "reward.args={{bonus: 1, scale: 2}}")
    with pytest.raises(PluginError, match=r"^reward.args.scale: no function of reward.fn=.* takes it$"):
        reward_pool_for(cfg)


def test_rank0_counts_every_generated_episode_and_averages_what_they_logged():
    gen = GeneratedEpisodes()
    failing = [EpisodeStats(turns=1, reward_errors=1) for _ in range(4)]  # a uniform group: all scored 0
    logged = [EpisodeStats(turns=2, tool_calls=1, logged={"reward/x": float(i), "episode/n": 1.0}) for i in range(4)]
    logged[0].logged.pop("episode/n")
    # an episode the workflow rejected (an agent that failed) ran again: its failures count, the episode does not
    rejected = [EpisodeStats(turns=1, reward_errors=1, agent_failures=1, branches=1)]
    gen.add(group_counts(failing) | {"group_id": 0})
    gen.add(group_counts(logged, rejected) | {"group_id": 1})
    row = gen.row()
    assert row == {
        "episodes_generated": 8,
        "reward_timeouts": 0,
        "reward_errors": 5,
        "branches": 1,
        "agent_failures": 1,
        "episode/n": 1.0,
        "reward/x": 1.5,
    }
    assert gen.row()["reward_errors"] == 0  # a row counts the episodes since the previous one
    s = gen.summary()
    assert s["reward_errors"] == 5 and s["turns_per_episode"] == 1.5 and s["tool_calls_per_episode"] == 0.5
    assert s["agent_failures"] == 1 and s["branches"] == 1
