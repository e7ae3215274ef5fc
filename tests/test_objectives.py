"""The objective menu (clip-higher, dual-clip, aggregations, GSPO, TIS, KL, entropy) against a direct computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from areal_hpc.algo.ppo import Objective, sequence_weights
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.model import load_causal_lm
from areal_hpc.types import Trajectory

NORM = 7  # Dr.GRPO's constant in these tests


def _batch(vocab: int, seed: int = 0):
    """Six sequences with a prompt, answer tokens and an untrained span (a tool's output) between them."""
    rng = np.random.default_rng(seed)
    trajs = []
    for i, (n_prompt, n_ans) in enumerate([(3, 9), (4, 5), (2, 12), (5, 7), (3, 4), (2, 10)]):
        n = n_prompt + n_ans
        mask = np.zeros(n, np.uint8)
        mask[n_prompt:] = 1
        if n_ans > 8:
            mask[n_prompt + 3 : n_prompt + 5] = 0
        behav = np.where(mask > 0, -rng.uniform(0.5, 4.0, n), 0).astype(np.float32)
        versions = np.where(mask > 0, 0, -1).astype(np.int32)
        ids = rng.integers(1, vocab, n).astype(np.int32)
        trajs.append(Trajectory(i // 2, i // 2, i % 2, ids, behav, versions, mask, n_prompt))
    adv = np.array([1.0, -1.0, 0.7, -1.3, 0.4, -0.2], np.float32)
    return trajs, adv


def _reference_loss(model, trajs, adv, prox, ref, obj: Objective, agg: str, temperature: float = 1.0):
    """The objective written token by token from docs/algorithm.md, on the full logits of each sequence."""
    per_seq, n_tokens = [], []
    for i, t in enumerate(trajs):
        ids = torch.as_tensor(t.input_ids, dtype=torch.long)[None]
        logsm = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / temperature, -1)
        lp = logsm.gather(-1, ids[0, 1:, None]).squeeze(-1)
        ent = -(logsm.exp() * logsm).sum(-1)
        toks = [k for k in range(1, len(t.input_ids)) if t.loss_mask[k]]
        n_tokens.append(len(toks))
        a = float(adv[i])
        if obj.importance == "sequence":  # the sequence ratio itself, differentiated as a whole (GSPO)
            s = torch.exp(torch.stack([lp[k - 1] - float(prox[i][k]) for k in toks]).mean())
            w_seq = math.exp(np.mean([float(prox[i][k]) - float(t.behav_logprobs[k]) for k in toks]))
        terms = []
        for k in toks:
            p, b = float(prox[i][k]), float(t.behav_logprobs[k])
            u, w = (s, w_seq) if obj.importance == "sequence" else (torch.exp(lp[k - 1] - p), math.exp(p - b))
            term = torch.zeros(())
            if obj.behav_cap is None or w <= obj.behav_cap or obj.behav_weight == "truncate":
                w = min(w, obj.behav_cap) if obj.behav_cap is not None else w
                hi = obj.eps_clip if obj.eps_clip_high is None else obj.eps_clip_high
                j = torch.minimum(u * a, torch.clamp(u, 1 - obj.eps_clip, 1 + hi) * a)
                if obj.dual_clip and a < 0:
                    j = torch.maximum(j, torch.tensor(obj.dual_clip * a))
                term = term - w * j
            if obj.kl_coef:
                x = float(ref[i][k]) - lp[k - 1]  # log(ref / pi)
                kl = {"k1": -x, "k2": 0.5 * x**2, "k3": torch.exp(x) - 1 - x}[obj.kl_estimator]
                term = term + obj.kl_coef * kl
            term = term - obj.entropy_coef * ent[k - 1]
            terms.append(term)
        per_seq.append(torch.stack(terms).sum())
    n_seq = len(trajs)
    if agg == "token_mean":
        return sum(per_seq) / sum(n_tokens)
    if agg == "seq_mean_token_mean":
        return sum(x / n for x, n in zip(per_seq, n_tokens)) / n_seq
    return sum(per_seq) / (n_seq * NORM)


CASES = {
    "decoupled": (Objective(behav_cap=2.0), "token_mean"),
    "clip_higher_dual": (Objective(eps_clip=0.1, eps_clip_high=0.28, dual_clip=1.05, behav_cap=2.0), "token_mean"),
    "seq_mean_token_mean": (Objective(behav_cap=2.0), "seq_mean_token_mean"),
    "dr_grpo": (Objective(), "seq_mean_token_sum_norm"),
    "gspo": (
        Objective(eps_clip=0.01, eps_clip_high=0.015, importance="sequence", behav_cap=1.6),
        "seq_mean_token_mean",
    ),
    "tis": (Objective(behav_cap=1.5, behav_weight="truncate"), "token_mean"),
    "kl_k1": (Objective(kl_coef=0.3, kl_estimator="k1"), "token_mean"),
    "kl_k2": (Objective(kl_coef=0.3, kl_estimator="k2"), "token_mean"),
    "kl_k3": (Objective(kl_coef=0.3, kl_estimator="k3"), "seq_mean_token_mean"),
    "entropy": (Objective(entropy_coef=0.05), "token_mean"),
    "all": (
        Objective(0.1, 0.28, 1.05, 2.0, "truncate", "sequence", 0.2, "k3", 0.05),
        "seq_mean_token_sum_norm",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["fused", "zero3_checkpointed"])
def test_every_objective_equals_the_direct_computation_in_loss_and_gradients(tiny_qwen_dir, case, path):
    obj, agg = CASES[case]
    tr = TorchTrainEngine(
        str(tiny_qwen_dir), objective=obj, loss_agg=agg, loss_norm_tokens=NORM, logprob_chunk_tokens=5, seed=0
    )
    if path == "zero3_checkpointed":
        tr.fixed_chunks = 4  # the ZeRO-3 path: a fixed number of head calls, checkpointed, the loss taken at once
    trajs, adv = _batch(tr.model.config.vocab_size)
    rng = np.random.default_rng(1)
    current = tr.compute_logprobs([t.input_ids for t in trajs])
    # proximal logprobs straddle the clip range around the current policy; behaviour ones straddle the cap
    prox = [np.where(t.loss_mask > 0, c + 0.25 * rng.standard_normal(len(c)), 0) for t, c in zip(trajs, current)]
    for t, p in zip(trajs, prox):
        t.behav_logprobs[:] = np.where(t.loss_mask > 0, p + 0.5 * rng.standard_normal(len(p)), 0)
    ref = [np.where(t.loss_mask > 0, c + 0.4 * rng.standard_normal(len(c)), 0) for t, c in zip(trajs, current)]

    idx = list(range(len(trajs)))
    n_tok = [int(t.loss_mask.sum()) for t in trajs]
    weights = dict(zip(idx, sequence_weights(n_tok, agg, sum(n_tok), len(trajs), NORM)))
    prox_t = [torch.as_tensor(p, dtype=torch.float32) for p in prox]
    ref_t = [torch.as_tensor(r, dtype=torch.float32) for r in ref]
    loss, stats = tr._ppo_micro(trajs, adv, prox_t, ref_t if obj.kl_coef else [None] * 6, idx, weights)
    tr.model.zero_grad()
    loss.backward()
    got = torch.cat([p.grad.reshape(-1) for p in tr.model.parameters()])

    model = load_causal_lm(tiny_qwen_dir)
    model.load_state_dict(tr.model.state_dict())
    want_loss = _reference_loss(model, trajs, adv, prox, ref, obj, agg)
    want_loss.backward()
    want = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])
    torch.testing.assert_close(loss.detach(), want_loss.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert float(want.norm()) > 0
    # the cases reach what they are about: some ratios clipped, weights over the cap, a KL that is not 0
    if case in ("decoupled", "clip_higher_dual", "gspo"):
        assert 0 < stats["clip_frac"] < 1, stats
    if case == "tis":
        assert 0 < stats["truncated_frac"] < 1 and stats.get("capped_frac", 0) == 0
    if obj.kl_coef:
        assert stats["kl"] > 0
    if obj.entropy_coef:
        assert stats["entropy_bonus"] > 0
    if obj.importance == "sequence":
        assert "seq_ratio_mean" in stats
