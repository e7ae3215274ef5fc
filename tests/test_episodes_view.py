"""Stored episodes read back from a run directory alone (store.load_episodes) and printed (`areal-hpc episodes`)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_agent_runs import short_agent_demo

from areal_hpc.cli.main import main
from areal_hpc.config import load_config
from areal_hpc.launch.local import launch
from areal_hpc.model import load_tokenizer
from areal_hpc.rundir import RunDir
from areal_hpc.store import list_shards, load_episodes, load_trajectories, write_shard
from areal_hpc.store.shards import read_columns
from areal_hpc.types import EpisodeCounts, Trajectory

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "jobs" / "examples" / "calculator_agent.py"
VERSIONS = 2
CALL = re.compile(r'<tool_call>\{"name":"calculator","arguments":\{"expression":"([0-9+*-]+)"\}\}</tool_call>')
HEADER = re.compile(r"^episode (\d+):(\d+)  prompt (\d+)  reward (\S+)  versions (-?\d+)\.\.(-?\d+)  ", re.M)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One short run of the agent demo (the plain `openai` calculator agent), shared by every test here."""
    tmp = tmp_path_factory.mktemp("episodes")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the demo's agent path is relative to the repository root
        cfg = load_config(
            ROOT / "jobs" / "demo_agent.yaml",
            [*short_agent_demo(f"{AGENT}:agent", tmp / "run", tmp / "model", VERSIONS), "logging.progress=false"],
        )
        s = launch(cfg, progress=False)
    assert s["versions"] == VERSIONS and s["failure"] is None
    return tmp / "run"


@pytest.fixture(scope="module")
def episodes(run):
    return load_episodes(run)


@pytest.fixture(scope="module")
def tok(run):
    return load_tokenizer(run.parent / "model")


def _sampled_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of loss mask 1."""
    edges = np.flatnonzero(np.diff(np.r_[0, mask, 0]))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def _keys(eps) -> list[tuple[int, int]]:
    return [(ep.group_id, ep.sample_idx) for ep in eps]


def test_every_stored_token_comes_back_with_its_episode(run, episodes):
    """Each stored trajectory is one transcript of one episode, its arrays, fields and episode counts exactly the
    shard's, its consumed version and staleness the loader's."""
    stored, table = {}, {}
    for p in list_shards(RunDir(run).rollouts):
        c = read_columns(p)
        for i, t in enumerate(c.trajectories()):
            stored[p.name, i] = t
        for row in zip(*(c.episodes[k].tolist() for k in c.episodes)):
            table[row[:2]] = EpisodeCounts(*row)
    seen = [(t.shard, t.index) for ep in episodes for t in ep.transcripts]
    assert sorted(seen) == sorted(stored) and len(episodes) == len(table)
    df = load_trajectories(run).set_index(["shard", "index"])
    for ep in episodes:
        assert ep.counts == table[ep.group_id, ep.sample_idx]
        for t in ep.transcripts:
            want = stored[t.shard, t.index]
            assert (want.group_id, want.sample_idx, want.prompt_id) == (ep.group_id, ep.sample_idx, ep.prompt_id)
            for name in ("input_ids", "loss_mask", "behav_logprobs", "versions"):
                assert np.array_equal(getattr(t, name), getattr(want, name)), name
            assert (t.prompt_len, t.reward, t.finish_reason) == (want.prompt_len, want.reward, want.finish_reason)
            assert (t.version_start, t.version_end) == (want.version_start, want.version_end)
            loaded = df.loc[(t.shard, t.index)]
            assert t.consumed_version == loaded["consumed_version"]
            assert t.staleness == (None if loaded["consumed_version"] < 0 else loaded["staleness"])
    # two versions of 8 prompts x 8 samples were trained on: those episodes say by which version
    assert sum(ep.consumed_version >= 0 for ep in episodes) == VERSIONS * 8 * 8
    assert all(ep.staleness == ep.consumed_version - ep.version_start for ep in episodes if ep.staleness is not None)


def test_segments_cut_a_transcript_where_training_starts_and_stops(episodes, tok):
    """The segments lay the transcript end to end: the prompt first, then runs that are all trained or all not;
    the trained ones are exactly the loss mask's runs of 1, and each text is its tokens decoded."""
    for ep in episodes:
        for t in ep.transcripts:
            segs = t.segments
            assert np.array_equal(np.concatenate([s.ids for s in segs]), t.input_ids)
            assert [s.start for s in segs] == np.cumsum([0] + [len(s.ids) for s in segs[:-1]]).tolist()
            assert segs[0].prompt and len(segs[0].ids) == t.prompt_len and not any(s.prompt for s in segs[1:])
            trained = [(s.start, s.start + len(s.ids)) for s in segs if s.trained]
            assert trained and trained == _sampled_runs(t.loss_mask)
            for s in segs:
                assert s.text == tok.decode(s.ids.tolist(), skip_special_tokens=False)
                if not s.trained:
                    assert (s.versions == -1).all() and (s.logprobs == 0).all()
            assert all(a.trained != b.trained for a, b in zip(segs[1:], segs[2:]))


def test_a_calculator_call_is_followed_by_its_result_untrained(episodes):
    """In a multi-turn episode, the untrained segment after a sampled calculator call holds exactly what the agent
    sent back: the calculator's result (jobs/examples/calculator_agent.py calculate) as the chat template renders
    it, then the next prompt."""
    spec = importlib.util.spec_from_file_location(AGENT.stem, AGENT)
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    checked = 0
    for ep in episodes:
        segs = ep.transcripts[-1].segments
        for call, result in zip(segs[1:], segs[2:]):
            # a call the endpoint read as one (vLLM's parser): the agent answered it with a tool message
            if call.trained and (m := CALL.search(call.text)) and "<tool>" in result.text:
                sent = agent.calculate(m.group(1))  # what the agent computed and sent back as the tool's message
                if not re.fullmatch(r"-?\d+", sent):
                    continue  # an error text: the tiny vocabulary has no letters (stored as <unk>)
                # the template closes a turn with <eos>: appended unless sampled (a turn cut at its length)
                glue = "" if call.text.endswith("<eos>") else "<eos>"
                assert not result.trained and result.text == f"{glue}<tool>{sent}<assistant>", result.text
                assert ep.counts.turns >= 2 and ep.counts.tool_calls >= 1
                checked += 1
    assert checked > 0, "the warm-started policy never called the calculator"


def test_each_episode_carries_its_dataset_row(episodes):
    for ep in episodes:
        assert ep.row_index >= 0 and set(ep.row) == {"question", "answer"}
        assert ep.transcripts[0].segments[0].text == f"<user>{ep.row['question']}<assistant>"
        final = ep.transcripts[-1].segments[-1].text
        assert ep.reward in (0.0, 1.0) and (ep.reward == 1.0) <= (f"\\boxed{{{ep.row['answer']}}}" in final)


def test_episodes_filter_and_order(run, episodes):
    rewards = sorted(ep.reward for ep in episodes)
    lowest = load_episodes(run, lowest=True, limit=len(episodes) // 2)
    assert [ep.reward for ep in lowest] == rewards[: len(episodes) // 2]
    pid = episodes[-1].prompt_id
    own = load_episodes(run, prompt_id=pid, rows=False)
    assert _keys(own) == _keys(ep for ep in episodes if ep.prompt_id == pid)
    assert own and all(ep.row == {} for ep in own)
    lo, hi = min(ep.version_start for ep in episodes), max(ep.version_end for ep in episodes)
    assert len(load_episodes(run, versions=(lo, hi))) == len(episodes)
    assert load_episodes(run, versions=(hi + 1, None)) == []
    assert _keys(load_episodes(run, failed=True)) == _keys(ep for ep in episodes if ep.failures)


class _Chars:
    """A tokenizer stand-in: token i decodes as chr(97 + i)."""

    def decode(self, ids, **_):
        return "".join(chr(97 + i) for i in ids)


def _trajectory(group_id, sample_idx, versions, mask, reward=0.0) -> Trajectory:
    n = len(mask)
    return Trajectory(
        prompt_id=group_id,
        group_id=group_id,
        sample_idx=sample_idx,
        input_ids=np.arange(n, dtype=np.int32),
        behav_logprobs=-np.asarray(mask, dtype=np.float32),
        versions=np.asarray(versions, dtype=np.int32),
        loss_mask=np.asarray(mask, dtype=np.uint8),
        prompt_len=2,
        reward=reward,
    )


def test_failed_branched_and_version_filters_on_a_written_store(tmp_path):
    """A store written by hand: an episode that branched into two transcripts, one with a tool error, episodes
    sampled by weights 1 and 5."""
    m, v1, v5 = [0, 0, 1, 1, 0, 1], [-1, -1, 1, 1, -1, 1], [-1, -1, 5, 5, -1, 5]
    trajectories = [_trajectory(0, 0, v1, m), _trajectory(0, 0, v1, m), _trajectory(0, 1, v5, m, reward=1.0)]
    counts = [EpisodeCounts(0, 0, turns=3, tool_calls=2), EpisodeCounts(0, 1, tool_errors=1)]
    write_shard(RunDir(tmp_path).rollouts, trajectories, gen_rank=1, seq=0, episodes=counts)

    def picked(**how) -> list[int]:
        return [ep.sample_idx for ep in load_episodes(tmp_path, rows=False, tokenizer=_Chars(), **how)]

    eps = load_episodes(tmp_path, rows=False, tokenizer=_Chars())
    assert [(len(ep.transcripts), ep.branches, ep.failures) for ep in eps] == [(2, 1, 0), (1, 0, 1)]
    assert [s.text for s in eps[0].transcripts[1].segments] == ["ab", "cd", "e", "f"]
    assert eps[0].counts.turns == 3 and eps[0].staleness is None
    assert eps[1].version_start == 5 and picked(failed=True) == [1] and picked(versions=(2, 5)) == [1]
    assert picked(versions=(None, 1)) == [0] and picked(lowest=True, limit=1) == [0] and picked(limit=1) == [0]


def _cli(*args):
    return CliRunner().invoke(main, ["episodes", *map(str, args)])


def test_the_episodes_command_prints_headers_and_marked_segments(run, episodes):
    r = _cli(run)  # not a terminal: markers, no colour
    assert r.exit_code == 0, r.output
    heads = HEADER.findall(r.output)
    assert [(int(g), int(s)) for g, s, *_ in heads] == _keys(episodes[:3])
    for (*_, reward, vs, ve), ep in zip(heads, episodes):
        assert (float(reward), int(vs), int(ve)) == (ep.reward, ep.version_start, ep.version_end)
    assert "\x1b[" not in r.output
    lines = r.output.splitlines()
    assert any(line.startswith("[prompt]    <user>") for line in lines)
    assert any(line.startswith("[trained]   ") for line in lines)
    tools = _cli(run, "--n", len(episodes), "--no-color").output.splitlines()
    assert any(re.fullmatch(r"\[untrained\] <tool>\d+<assistant>", line) for line in tools)
    coloured = _cli(run, "--color", "--n", 1)
    assert "\x1b[32m" in coloured.output and "[trained]" not in coloured.output


def test_the_episodes_command_orders_and_filters(run, episodes):
    r = _cli(run, "--lowest", "--n", 5)
    rewards = [float(h[3]) for h in HEADER.findall(r.output)]
    assert rewards == sorted(ep.reward for ep in episodes)[:5]
    pid = episodes[-1].prompt_id
    heads = HEADER.findall(_cli(run, "--prompt", pid, "--n", 100).output)
    assert heads and {int(h[2]) for h in heads} == {pid}
    assert len(heads) == sum(ep.prompt_id == pid for ep in episodes)
    none = _cli(run, "--versions", f"{max(ep.version_end for ep in episodes) + 1}:")
    assert none.exit_code == 0 and none.output == "no stored episode matches\n"


def test_the_episodes_command_refuses_in_one_line(tmp_path, run):
    for args in ([tmp_path / "nowhere"], [run, "--versions", "x"], [run, "--versions", "3:1"]):
        r = _cli(*args)
        assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1, r.output
        assert "Traceback" not in r.output
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / RunDir(run).config.name).write_text(RunDir(run).config.read_text())
    r = _cli(tmp_path / "empty")
    assert r.exit_code != 0 and r.output.strip().splitlines() == [
        f"Error: run {str(tmp_path / 'empty')!r} has no shards yet: no episode is stored"
    ]
