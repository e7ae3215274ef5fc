"""Episode counts have one schema (areal_hpc/count_schema.py): adding a count there is the one edit it takes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areal_hpc import count_schema
from areal_hpc.count_schema import COUNTS, GROUP_COUNTS
from areal_hpc.episode_counts import episode_metrics, episode_stats, group_counts
from areal_hpc.runtime.comm.protocol import GROUP_FIELDS
from areal_hpc.runtime.reporting.generated import GeneratedEpisodes
from areal_hpc.store.columns import EPISODE_DTYPES
from areal_hpc.store.shards import write_shard
from areal_hpc.types import EpisodeCounts, Trajectory
from areal_hpc.workflow.records import EpisodeStats

PACKAGE = Path(__file__).resolve().parents[1] / "areal_hpc"

# The one edit: two counts appended to the schema, one per route to metrics.csv.
ADDED = """    Count("env_steps", "<i4", "trained", "environment steps", per_episode=True),
    Count("judge_calls", "<i4", "generated", "calls to a judge model", failures=True),
"""


def _traj(group: int, sample: int) -> Trajectory:
    n = 5
    return Trajectory(
        prompt_id=group,
        group_id=group,
        sample_idx=sample,
        input_ids=np.arange(n, dtype=np.int32),
        behav_logprobs=np.zeros(n, dtype=np.float32),
        versions=np.array([-1, -1, 0, 0, 0], dtype=np.int32),
        loss_mask=np.array([0, 0, 1, 1, 1], dtype=np.uint8),
        prompt_len=2,
    )


def test_the_schema_keeps_the_names_and_dtypes_shards_and_reports_have_today():
    # renaming or retyping one would leave existing shards unreadable and runs' columns unmatched
    assert EPISODE_DTYPES == {
        "group_id": np.dtype("<i8"),
        "sample_idx": np.dtype("<i8"),
        "turns": np.dtype("<i4"),
        "tool_calls": np.dtype("<i4"),
        "tool_errors": np.dtype("<i4"),
        "tool_s": np.dtype("<f4"),
        "reward_timeouts": np.dtype("<i4"),
        "reward_errors": np.dtype("<i4"),
    }
    assert [f.name for f in dataclasses.fields(EpisodeCounts)] == list(EPISODE_DTYPES)
    assert EpisodeCounts(0, 0).turns == 1 and EpisodeStats().turns == 0  # a single generate call; nothing yet
    sent = ("episodes", "turns", "tool_calls", "reward_timeouts", "reward_errors", "branches", "agent_failures")
    assert GROUP_COUNTS == sent
    assert set(GROUP_COUNTS) <= set(GROUP_FIELDS)
    gen = GeneratedEpisodes()
    gen.add(group_counts([EpisodeStats(turns=2, tool_calls=1, reward_errors=1)]) | {"group_id": 0})
    assert gen.row() == {
        "episodes_generated": 1,
        "reward_timeouts": 0,
        "reward_errors": 1,
        "branches": 0,
        "agent_failures": 0,
    }
    assert list(gen.summary()) == [
        "after_last_row",
        "episodes_generated",
        "reward_timeouts",
        "reward_errors",
        "branches",
        "agent_failures",
        "agent_failures_by_kind",
        "turns_per_episode",
        "tool_calls_per_episode",
    ]
    stats = episode_stats([_traj(0, 0), _traj(0, 1)])
    columns = ["tool_calls", "tool_errors", "tool_s", "unsampled_tokens", "turns_mean", "trained_share"]
    assert list(episode_metrics([stats], 2)) == columns


def test_a_count_that_cannot_work_is_refused():
    trained_unstored = dataclasses.replace(COUNTS[1], name="env_steps", stored=False)
    for bad, why in (
        (trained_unstored, "must be stored"),
        (dataclasses.replace(COUNTS[0]), "taken"),
        (dataclasses.replace(COUNTS[0], name="episodes"), "taken"),
        (dataclasses.replace(COUNTS[0], name="x", summed_into="kept"), "not trained or generated"),
    ):
        with pytest.raises(ValueError, match=why):
            count_schema.check((*COUNTS, bad))
    count_schema.check(COUNTS)


# Run in a copy of the package whose schema has the added counts: every home of the counts must show them.
CHECKS = r"""
import json, sys
import h5py
import numpy as np
from areal_hpc.episode_counts import episode_metrics, episode_stats, group_counts
from areal_hpc.runtime.comm.protocol import GROUP_FIELDS, ProtocolError, Tag, check_fields
from areal_hpc.runtime.reporting.generated import GeneratedEpisodes
from areal_hpc.store.shards import read_columns, read_shard_summary, write_shard
from areal_hpc.types import EpisodeCounts
from areal_hpc.workflow.records import EpisodeStats
import areal_hpc, pickle

old_shard, tmp = sys.argv[1], sys.argv[2]
trajs = pickle.load(open(sys.argv[3], "rb"))
out = {"package": areal_hpc.__file__}
# the records
st = EpisodeStats(turns=1, env_steps=3, judge_calls=1)
st.add_failures(EpisodeStats(judge_calls=2, env_steps=7))  # a rejected try: its failures carry, not the rest
out["stats"] = [st.env_steps, st.judge_calls]
# the shard's episode table, written and read back
table = [EpisodeCounts(t.group_id, t.sample_idx, env_steps=4 + t.sample_idx, judge_calls=1) for t in trajs]
path = write_shard(tmp, trajs, 0, 0, episodes=table)
with h5py.File(path, "r") as f:
    out["datasets"] = sorted(f["episodes"])
cols = read_columns(path)
out["read"] = [cols.episodes["env_steps"].tolist(), cols.episodes["judge_calls"].tolist()]
# a shard written before the counts existed reads them at their unset value
old = read_columns(old_shard)
out["old"] = [old.episodes["env_steps"].tolist(), old.episodes["judge_calls"].tolist()]
out["old_summary"] = read_shard_summary(old_shard).episodes["judge_calls"].tolist()
# the GROUPS_DONE entry, checked against the protocol
counts = group_counts([st, EpisodeStats(env_steps=1)], [EpisodeStats(judge_calls=5)])
out["group"] = [counts["env_steps"], counts["judge_calls"]]
group = {k: 0 for k in GROUP_FIELDS} | counts
check_fields(Tag.GROUPS_DONE, {"shard": "s", "groups": [group]})
try:
    check_fields(Tag.GROUPS_DONE, {"shard": "s", "groups": [{k: v for k, v in group.items() if k != "judge_calls"}]})
    out["refused"] = False
except ProtocolError:
    out["refused"] = True
out["fields"] = [k in GROUP_FIELDS for k in ("env_steps", "judge_calls")]
# the version's sums over its trained episodes
out["version"] = episode_metrics([episode_stats(cols)], len(cols))["env_steps"]
# rank 0's sums over every generated episode: the row, the run's totals and summary
gen = GeneratedEpisodes()
gen.add(dict(group))
row = gen.row()
gen.add(dict(group))
s = gen.summary()
late = s["after_last_row"]["judge_calls"]
out["generated"] = [row["judge_calls"], gen.totals()["judge_calls"], s["judge_calls"], late]
out["per_episode"] = s["env_steps_per_episode"]
print(json.dumps(out))
"""


def test_adding_a_count_is_one_edit_to_the_schema(tmp_path):
    import pickle

    trajs = [_traj(3, 0), _traj(3, 1)]
    old_shard = write_shard(tmp_path / "old", trajs, 0, 0)  # today's schema: no env_steps, no judge_calls
    (tmp_path / "trajs.pkl").write_bytes(pickle.dumps(trajs))
    copy = tmp_path / "src" / "areal_hpc"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    schema = copy / "count_schema.py"
    src = schema.read_text()
    end = src.index("\n)\n", src.index("COUNTS: tuple[Count, ...] = ("))
    schema.write_text(src[: end + 1] + ADDED + src[end + 1 :])
    env = os.environ | {"PYTHONPATH": str(copy.parent)}
    run = subprocess.run(
        [sys.executable, "-c", CHECKS, str(old_shard), str(tmp_path / "new"), str(tmp_path / "trajs.pkl")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["package"].startswith(str(copy))  # the edited copy ran, not the installed package
    assert out["stats"] == [3, 3]
    assert {"env_steps", "judge_calls"} <= set(out["datasets"])
    assert out["read"] == [[4, 5], [1, 1]]
    assert out["old"] == [[0, 0], [0, 0]] and out["old_summary"] == [0, 0]
    assert out["group"] == [4, 8]  # env_steps over the kept episodes; judge_calls over the rejected try too
    assert out["fields"] == [True, True] and out["refused"]
    assert out["version"] == 9
    assert out["generated"] == [8, 16, 16, 8]
    assert out["per_episode"] == 4 * 2 / 4
