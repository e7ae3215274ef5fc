"""The training-inference gap each version, measured by the torch trainer against a direct forward of its weights."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from areal_hpc.algo.mismatch import gap_figures, gap_sums, row_columns, version_sums, without_sums
from areal_hpc.algo.packing import balance_across_ranks
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.model import load_causal_lm

VERSION = 3  # the weights the trainer holds; tokens of this version are staleness 0


@pytest.fixture(scope="module")
def mixed(ppo_batch):
    """The batch with behaviour logprobs moved off the sampler's: every other trajectory wholly of version 3
    (staleness 0), moved by a little (the numeric mismatch); the others mix versions 1..3 (a load in flight, or
    staleness), moved by more."""
    trajs, adv = ppo_batch
    out = []
    for i, t in enumerate(trajs):
        gen = np.arange(t.prompt_len, len(t.input_ids))
        versions, behav = t.versions.copy(), t.behav_logprobs.copy()
        versions[gen] = VERSION if i % 2 == 0 else np.sort(VERSION - (gen + i) % 3)  # older tokens first
        behav[gen] += 0.05 * np.sin(gen + i) if i % 2 == 0 else -0.4 + 0.1 * np.cos(gen)
        out.append(dataclasses.replace(t, versions=versions, behav_logprobs=behav.astype(np.float32)))
    return out, adv


def _direct_logprobs(model_dir, trajs) -> list[np.ndarray]:
    """Each token's logprob under the model folder's weights: one plain transformers forward per sequence."""
    model = load_causal_lm(model_dir, "float32").eval()
    out = []
    with torch.no_grad():
        for t in trajs:
            ids = torch.as_tensor(t.input_ids, dtype=torch.long)[None]
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(np.concatenate([[0.0], logp.numpy()]))
    return out


def _fresh(t, fresh_only: bool = True) -> np.ndarray:
    """Loss tokens of a trajectory sampled wholly by version VERSION (all of them with fresh_only=False)."""
    return (t.loss_mask > 0) & ((t.versions[t.loss_mask > 0].min() == VERSION) or not fresh_only)


def _expected(trajs, lps, fresh_only: bool) -> dict:
    mask = np.concatenate([_fresh(t, fresh_only) for t in trajs])
    seq = np.concatenate([np.full(len(t.input_ids), j) for j, t in enumerate(trajs)])
    behav = np.concatenate([t.behav_logprobs for t in trajs])
    return gap_figures(gap_sums(behav, np.concatenate(lps), mask, seq))


@pytest.mark.parametrize(
    "decoupled,prox",
    [(True, "recompute"), (False, "recompute"), (True, "loglinear")],
    ids=["recompute", "plain", "loglinear"],
)
def test_the_trainer_measures_its_own_logprobs_against_the_behaviour_ones(tiny_model_dir, mixed, decoupled, prox):
    trajs, adv = mixed
    tr = TorchTrainEngine(str(tiny_model_dir), lr=1e-2, n_minibatches=2, decoupled=decoupled, prox=prox)
    tr.version = VERSION
    minibatches = balance_across_ranks([len(t.input_ids) for t in trajs], 2)
    stats = tr.ppo_update(trajs, adv, minibatches)
    row = row_columns([stats])
    # with the recompute, every trajectory; without one, the first minibatch's (its forward precedes any step)
    measured = [trajs[i] for i in sorted(minibatches[0])] if prox == "loglinear" or not decoupled else trajs
    lps = _direct_logprobs(tiny_model_dir, measured)
    for name, fresh_only in (("mismatch", True), ("offpolicy", False)):
        want = _expected(measured, lps, fresh_only)
        tokens = sum(int(_fresh(t, fresh_only).sum()) for t in measured)
        assert row[f"{name}_tokens"] == want["tokens"] == tokens > 0
        for k in ("k1", "k3", "chi2", "log_ppl_diff", "max_ratio", "mult_prob_err", "ess"):
            assert row[f"{name}_{k}"] == pytest.approx(want[k], rel=1e-3, abs=1e-6), (name, k)
    # stale tokens add staleness on top of the mismatch: the all-token gap is the larger
    assert row["offpolicy_k3"] > 5 * row["mismatch_k3"] > 0
    r = np.concatenate([lp[_fresh(t)] - t.behav_logprobs[_fresh(t)] for t, lp in zip(measured, lps)])
    assert row["mismatch_k3"] == pytest.approx(np.mean(np.exp(r) - 1 - r), rel=1e-3)  # the formula, written out
    # a version-3 token of a trajectory begun on older weights (over their KV cache) is not counted as staleness 0
    per_token = sum(int(((t.loss_mask > 0) & (t.versions == VERSION)).sum()) for t in measured)
    assert row["mismatch_tokens"] < per_token
    assert tr.version == VERSION + 1 and all(math.isfinite(v) for v in stats.values())
    assert "mismatch_sums/n" not in without_sums(stats) and "loss" in without_sums(stats)


def test_sums_add_across_trainers_and_an_empty_version_leaves_its_cells_empty(mixed, tiny_model_dir):
    trajs, _ = mixed
    lps = _direct_logprobs(tiny_model_dir, trajs[:6])
    whole = row_columns([version_sums(trajs[:6], lps, VERSION)])
    parts = row_columns([version_sums(trajs[:2], lps[:2], VERSION), version_sums(trajs[2:6], lps[2:], VERSION)])
    assert parts.keys() == whole.keys() and all(parts[k] == pytest.approx(whole[k], rel=1e-9) for k in whole)
    # no staleness-0 token (every token a version old): mismatch_* shows only its zero count, offpolicy_* is whole
    old = row_columns([version_sums(trajs[:6], lps, VERSION + 1), version_sums([], [], VERSION + 1)])
    assert old["mismatch_tokens"] == 0 and not any(k.startswith("mismatch_") and k != "mismatch_tokens" for k in old)
    assert old["offpolicy_k3"] == pytest.approx(whole["offpolicy_k3"])
    assert row_columns([{"loss": 0.0}]) == {}  # a trainer that measures nothing (emulated): no columns
