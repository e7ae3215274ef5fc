"""The torch generation engine computes a group's shared prompt once, sampling what per-sample prefill samples."""

from __future__ import annotations

import numpy as np
import pytest
from request_helpers import group_requests

from areal_hpc.engines.base import generate
from areal_hpc.engines.torch_gen import TorchGenerationEngine
from areal_hpc.model import load_tokenizer
from areal_hpc.types import GenRequest


def _engines(path, **kw):
    return [TorchGenerationEngine(str(path), seed=7, share_prefill=share, **kw) for share in (True, False)]


def _same(a, b):
    assert [o.request_id for o in a] == [o.request_id for o in b]
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids, x.request_id
        np.testing.assert_allclose(x.output_logprobs, y.output_logprobs, atol=1e-5, rtol=0)


def test_a_group_prefills_its_prompt_once_and_samples_what_per_sample_prefill_samples(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    n, prompt = 8, tok.encode("12+34=" * 5)
    other = tok.encode("7+8=")
    # two groups of n sampled answers and a lone greedy request, all joining in one prefill
    reqs = group_requests(prompt, 0, n, 24) + group_requests(other, 1, 3, 24)
    reqs.append(GenRequest("solo", tok.encode("99+1="), 24, greedy=True))
    shared, plain = _engines(tiny_model_dir)
    for eng in (shared, plain):
        eng.ignore_eos = True
    outs = generate(shared, reqs)
    _same(outs, generate(plain, reqs))
    assert len({tuple(o.output_ids) for o in outs[:n]}) > 1  # sampled: the n answers differ
    # each group's prompt computed once, not once per sample
    solo = len(reqs[-1].prompt_ids)
    assert plain.prefill_tokens == n * len(prompt) + 3 * len(other) + solo
    assert shared.prefill_tokens == len(prompt) + len(other) + solo
    assert shared.prefill_shared_tokens == (n - 1) * len(prompt) + 2 * len(other)
    assert plain.prefill_shared_tokens == 0


def test_resumed_samples_share_only_their_common_prefix(tiny_model_dir):
    # recompute's resume: each sample comes back with its own partial answer; the prompt (and whatever the
    # partials have in common) is computed once, each partial after it over that prompt's keys and values
    tok = load_tokenizer(tiny_model_dir)
    prompt = tok.encode("45+45=")
    shared, plain = _engines(tiny_model_dir)
    outs = {}
    for eng in (shared, plain):
        eng.ignore_eos = True
        reqs = group_requests(prompt, 0, 6, 30)
        eng.add(reqs)
        for _ in range(6):
            eng.step()
        partial = {o.request_id: o for o in eng.interrupt()}
        eng.update_weights(eng.state_dict(), version=1)
        resumed = [r.resumed(partial[r.request_id]) for r in reqs]
        resumed.append(GenRequest("fresh", prompt, 30))  # a new sample of the same prompt: shares it too
        before = eng.prefill_tokens
        outs[eng.share_prefill] = (generate(eng, resumed), eng.prefill_tokens - before, resumed)
    _same(outs[True][0], outs[False][0])
    assert all(o.output_versions[:6] == [0] * 6 and o.output_versions[6:] == [1] * 24 for o in outs[True][0][:6])
    resumed = outs[True][2]
    full = sum(len(r.prompt_ids) + len(r.partial_ids) for r in resumed)
    assert outs[False][1] == full
    # the fresh sample has no partial, so the group shares the prompt exactly: computed once, then each partial
    assert outs[True][1] == len(prompt) + sum(len(r.partial_ids) for r in resumed)


def test_keep_kv_load_then_a_group_joins_under_the_new_weights(tiny_model_dir):
    # a group that joins after a keep_kv load shares a prefix computed by the new weights, while the rows
    # already running go on over theirs: the same as per-sample prefill
    tok = load_tokenizer(tiny_model_dir)
    prompt = tok.encode("3+4=" * 4)
    from areal_hpc.model import load_causal_lm

    new = load_causal_lm(tiny_model_dir)
    for p in new.parameters():
        p.data.mul_(1.05)
    got = {}
    for eng in _engines(tiny_model_dir):
        eng.ignore_eos = True
        eng.add(group_requests(prompt, 0, 4, 20))
        for _ in range(3):
            eng.step()
        eng.update_weights(new.state_dict(), version=1, keep_kv=True)
        eng.add(group_requests(prompt, 1, 4, 20))
        done = []
        while eng.num_running or eng.num_waiting:
            done += eng.step()
        got[eng.share_prefill] = sorted(done, key=lambda o: o.request_id)
    _same(got[True], got[False])


@pytest.mark.parametrize("qwen", [False, True])
def test_prefill_sharing_matches_on_both_tiny_architectures(tiny_model_dir, tiny_qwen_dir, qwen):
    path = tiny_qwen_dir if qwen else tiny_model_dir
    tok = load_tokenizer(path)
    reqs = group_requests(tok.encode("11+22="), 0, 5, 12) + group_requests(tok.encode("1+2=" * 3), 1, 2, 12)
    shared, plain = _engines(path, temperature=0.7)
    _same(generate(shared, reqs), generate(plain, reqs))
