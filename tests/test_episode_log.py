"""Workflow metrics and training control over the real torch engine: ep.log, a reward's extras, train=False."""

from __future__ import annotations

import math

import pytest
from test_workflow import RecordingEngine, _settings, _starts

from areal_hpc.episode_counts import group_counts
from areal_hpc.model import load_tokenizer
from areal_hpc.reward import RewardPool
from areal_hpc.reward.functions import MathAnswer, UserReward
from areal_hpc.types import SampleId
from areal_hpc.workflow import Episode, TooManyFailures
from areal_hpc.workflow.batch import run_episodes
from areal_hpc.workflow.samples import to_trajectories

REWARD = "def reward(completion, row):\n    return {'score': 0.25, 'chars': len(completion)}\n"


async def _drafts_then_answers(ep: Episode) -> float:
    draft = await ep.generate(max_new_tokens=3, train=False)  # seen by the next turn, never trained
    answer = await ep.generate()
    ep.log("draft_tokens", len(draft.ids))
    ep.log("answered", answer.finish_reason == "stop")
    return await ep.reward(answer.text)


async def _only_drafts(ep: Episode) -> float:
    await ep.generate(train=False)
    return 1.0


def test_logged_numbers_extras_and_an_untrained_turn_reach_the_episode_and_its_trajectory(tiny_model_dir, tmp_path):
    f = tmp_path / "r.py"
    f.write_text(REWARD)
    tok = load_tokenizer(tiny_model_dir)
    eng = RecordingEngine(str(tiny_model_dir), seed=5, max_num_seqs=8)
    with RewardPool(num_workers=1, scorer=UserReward(f"{f}:reward")) as pool:
        eps = run_episodes(eng, _drafts_then_answers, tok, pool, _settings(tok), _starts(tok, 6))
        outputs = dict(eng.outputs)  # the next batch's request ids are the same
        drafts_only = run_episodes(eng, _only_drafts, tok, pool, _settings(tok), _starts(tok, 2))
    for k, ep in enumerate(eps):
        draft, answer = sorted(
            (o for rid, o in outputs.items() if rid.episode == str(SampleId(0, k))),
            key=lambda o: o.request_id.call,
        )
        assert ep.reward == 0.25
        assert ep.stats.logged == {
            "episode/draft_tokens": float(len(draft.output_ids)),
            "episode/answered": float(answer.finish_reason == "stop"),
            "reward/chars": float(len(tok.decode(answer.output_ids, skip_special_tokens=True))),
        }
        (t,) = to_trajectories(ep, SampleId(0, k), 0, 0)
        p, d = t.prompt_len, len(draft.output_ids)
        assert answer.prompt_ids == t.input_ids[: p + d].tolist()  # the answer continued the draft
        # the draft keeps what it was sampled with, but its loss mask is 0; the answer is trained
        assert t.loss_mask[p : p + d].sum() == 0 and t.loss_mask[p + d :].all()
        assert t.behav_logprobs[p : p + d].tolist() == pytest.approx(draft.output_logprobs)
        assert (t.versions[p:] == 0).all() and t.version_start == 0
    counts = group_counts([e.stats for e in eps])
    assert counts["episodes"] == 6 and counts["turns"] == 12
    assert counts["logged"]["reward/chars"][1] == 6 and counts["logged"]["episode/draft_tokens"][1] == 6
    # an episode whose only sampled turn is untrained: one trajectory, nothing in the loss, its staleness known
    for k, ep in enumerate(drafts_only):
        (t,) = to_trajectories(ep, SampleId(1, k), 0, 0)
        assert t.gen_len > 0 and t.loss_mask.sum() == 0 and t.version_start == 0
    eng.close()


async def _logs_text(ep: Episode) -> float:
    ep.log("verdict", "yes")
    return 1.0


async def _logs_nan(ep: Episode) -> float:
    ep.log("ratio", math.nan)
    return 1.0


@pytest.mark.parametrize("flow, words", [(_logs_text, "'yes'"), (_logs_nan, "nan")])
def test_logging_a_non_number_fails_the_workflow_in_one_line(tiny_model_dir, flow, words):
    tok = load_tokenizer(tiny_model_dir)
    eng = RecordingEngine(str(tiny_model_dir), seed=5, max_num_seqs=2)
    pool = RewardPool(num_workers=1, scorer=MathAnswer())
    settings = _settings(tok, failure_window=4)
    with pool, pytest.raises(TooManyFailures, match="must be a finite number") as err:
        run_episodes(eng, flow, tok, pool, settings, _starts(tok, 2))
    assert "ep.log(" in str(err.value) and words in str(err.value) and "\n" not in str(err.value)
    eng.close()
