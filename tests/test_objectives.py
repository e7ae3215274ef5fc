"""Every term of the objective menu (docs/algorithm.md) against a direct computation with full logits."""

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


def _batch(vocab: int, seed: int = 0, shared: bool = False):
    """Six sequences with a prompt, answer tokens and an untrained span (a tool's output) between them.

    `shared`: nested prefixes, as a prefix tree lays them down once: all six open with the same 2 tokens, each
    pair (a group) shares its prompt, and the last pair also its first 3 answer tokens (trained tokens)."""
    rng = np.random.default_rng(seed)
    trajs = []
    preamble = rng.integers(1, vocab, 2)
    pair_prefix = [rng.integers(1, vocab, 8) for _ in range(3)]
    for i, (n_prompt, n_ans) in enumerate([(3, 9), (4, 5), (2, 12), (5, 7), (3, 4), (2, 10)]):
        if shared:
            n_prompt = 5
        n = n_prompt + n_ans
        mask = np.zeros(n, np.uint8)
        mask[n_prompt:] = 1
        if n_ans > 8:
            mask[n_prompt + 3 : n_prompt + 5] = 0
        behav = np.where(mask > 0, -rng.uniform(0.5, 4.0, n), 0).astype(np.float32)
        versions = np.where(mask > 0, 0, -1).astype(np.int32)
        ids = rng.integers(1, vocab, n).astype(np.int32)
        if shared:
            ids[:2], ids[2:5] = preamble, pair_prefix[i // 2][:3]
            if i >= 4:
                ids[5:8] = pair_prefix[2][5:]
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
        # the sequence's geometric-mean behaviour weight: GSPO's w, and what sequence rejection bounds
        w_seq = math.exp(np.mean([float(prox[i][k]) - float(t.behav_logprobs[k]) for k in toks]))
        rejected = (obj.seq_reject_low and w_seq < obj.seq_reject_low) or (
            obj.seq_reject_high and w_seq > obj.seq_reject_high
        )
        if obj.importance == "sequence":  # the sequence ratio itself, differentiated as a whole (GSPO)
            s = torch.exp(torch.stack([lp[k - 1] - float(prox[i][k]) for k in toks]).mean())
        terms = []
        for k in toks:
            p, b = float(prox[i][k]), float(t.behav_logprobs[k])
            u, w = (s, w_seq) if obj.importance == "sequence" else (torch.exp(lp[k - 1] - p), math.exp(p - b))
            term = torch.zeros(())
            if not rejected and (obj.behav_cap is None or w <= obj.behav_cap or obj.behav_weight == "truncate"):
                w = min(w, obj.behav_cap) if obj.behav_cap is not None else w
                hi = obj.eps_clip if obj.eps_clip_high is None else obj.eps_clip_high
                if obj.surrogate == "cispo":  # the clipped ratio a constant weight on log pi (CISPO)
                    j = float(torch.clamp(u.detach(), 1 - obj.eps_clip, 1 + hi)) * a * lp[k - 1]
                else:
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
    "cispo": (Objective(eps_clip=0.1, eps_clip_high=0.15, behav_cap=2.0, surrogate="cispo"), "token_mean"),
    "cispo_tis_kl_entropy": (
        Objective(0.1, 0.28, 0.0, 1.5, "truncate", "token", 0.2, "k2", 0.05, surrogate="cispo"),
        "seq_mean_token_mean",
    ),
    "seq_reject": (Objective(behav_cap=2.0, seq_reject_low=0.9, seq_reject_high=1.1), "token_mean"),
    "seq_reject_gspo": (
        Objective(0.01, 0.015, importance="sequence", behav_cap=1.6, seq_reject_low=0.9, seq_reject_high=1.1),
        "seq_mean_token_mean",
    ),
    # no recomputed proximal logprobs: the rejection's weights come from the prepass
    "seq_reject_loglinear": (Objective(seq_reject_low=0.9, seq_reject_high=1.1, entropy_coef=0.05), "token_mean"),
}
LOGLINEAR = {"seq_reject_loglinear"}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["fused", "zero3_checkpointed"])
@pytest.mark.parametrize("layout", ["packed", "prefix_tree"])
def test_every_objective_equals_the_direct_computation_in_loss_and_gradients(tiny_qwen_dir, case, path, layout):
    obj, agg = CASES[case]
    tree = layout == "prefix_tree"  # shared prefixes laid down once (shorter than the default threshold here)
    tr = TorchTrainEngine(
        str(tiny_qwen_dir),
        objective=obj,
        loss_agg=agg,
        loss_norm_tokens=NORM,
        logprob_chunk_tokens=5,
        seed=0,
        share_prefixes=tree,
        share_min_tokens=2,
    )
    if path == "zero3_checkpointed":
        tr.fixed_chunks = 4  # the ZeRO-3 path: a fixed number of head calls, checkpointed, the loss taken at once
    trajs, adv = _batch(tr.model.config.vocab_size, shared=tree)
    rng = np.random.default_rng(1)
    current = tr.compute_logprobs([t.input_ids for t in trajs])
    # proximal logprobs straddle the clip range around the current policy; behaviour ones straddle the cap
    prox = [np.where(t.loss_mask > 0, c + 0.25 * rng.standard_normal(len(c)), 0) for t, c in zip(trajs, current)]
    for t, p in zip(trajs, prox):
        t.behav_logprobs[:] = np.where(t.loss_mask > 0, p + 0.5 * rng.standard_normal(len(p)), 0)
    ref = [np.where(t.loss_mask > 0, c + 0.4 * rng.standard_normal(len(c)), 0) for t, c in zip(trajs, current)]
    if case in LOGLINEAR:  # version 3 trains tokens of version 0: pi_prox sits 3/4 of the way from behav to pi
        tr.version = 3
        prox = [t.behav_logprobs + 0.75 * (c - t.behav_logprobs) for t, c in zip(trajs, current)]

    idx = list(range(len(trajs)))
    n_tok = [int(t.loss_mask.sum()) for t in trajs]
    weights = dict(zip(idx, sequence_weights(n_tok, agg, sum(n_tok), len(trajs), NORM)))
    prox_t = [None] * 6 if case in LOGLINEAR else [torch.as_tensor(p, dtype=torch.float32) for p in prox]
    ref_t = [torch.as_tensor(r, dtype=torch.float32) for r in ref]
    tr.batching.reset()
    loss, stats = tr._ppo_micro(trajs, adv, prox_t, ref_t if obj.kl_coef else [None] * 6, idx, weights)[:2]
    # the tree computed each shared prefix once: 5 x 2 + 3 x 3 + 3 tokens fewer than the sequences hold
    assert tr.batching.unshared - tr.batching.positions == (22 if tree else 0)
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
    if case in ("decoupled", "clip_higher_dual", "gspo", "cispo", "cispo_tis_kl_entropy"):
        assert 0 < stats["clip_frac"] < 1, stats
    if obj.seq_reject_low:  # some sequences rejected, not all; without the bounds, no such stat
        assert 0 < stats["seq_rejected_frac"] < 1, stats
    else:
        assert "seq_rejected_frac" not in stats
    if case == "tis":
        assert 0 < stats["truncated_frac"] < 1 and stats.get("capped_frac", 0) == 0
    if obj.kl_coef:
        assert stats["kl"] > 0
    if obj.entropy_coef:
        assert stats["entropy_bonus"] > 0
    if obj.importance == "sequence":
        assert "seq_ratio_mean" in stats


def test_the_config_keys_reach_the_objective(tiny_model_dir):
    from areal_hpc.config import load_config
    from areal_hpc.runtime.build import objective

    keys = ["ppo.objective=cispo", "ppo.seq_reject_low=0.5", "ppo.seq_reject_high=2", "ppo.behav_weight=truncate"]
    obj = objective(load_config(None, [f"model.path={tiny_model_dir}", *keys]))
    assert (obj.surrogate, obj.seq_reject_low, obj.seq_reject_high, obj.behav_weight) == ("cispo", 0.5, 2, "truncate")
    assert objective(load_config(None, [f"model.path={tiny_model_dir}"])) == Objective(behav_cap=5.0)  # the defaults


def _held_parameters(engine) -> int:
    """Parameters of every module an engine holds (its reference's too), each tensor counted once."""
    seen = {}
    for v in vars(engine).values():
        for m in [v] + ([v.model] if hasattr(v, "model") and isinstance(v.model, torch.nn.Module) else []):
            if isinstance(m, torch.nn.Module):
                seen.update({id(p): p.numel() for p in m.parameters()})
    return sum(seen.values())


def test_no_kl_holds_no_reference_and_a_kl_keeps_the_starting_policy_across_a_resume(
    tiny_model_dir, ppo_batch, tmp_path
):
    trajs, adv = ppo_batch
    plain = TorchTrainEngine(str(tiny_model_dir), lr=1e-2, n_minibatches=1)
    plain.ppo_update(trajs, adv)
    n_params = sum(p.numel() for p in plain.model.parameters())
    assert plain.reference is None and _held_parameters(plain) == n_params  # no second copy of the weights
    kl = TorchTrainEngine(str(tiny_model_dir), lr=1e-2, n_minibatches=1, objective=Objective(kl_coef=0.5))
    start = {k: v.clone() for k, v in kl.weights().items()}
    first = kl.ppo_update(trajs, adv)
    assert _held_parameters(kl) == 2 * n_params  # the reference: one more copy, nothing else
    assert first["kl"] == 0  # the first version's policy is the reference
    kl.save_checkpoint(tmp_path / "ckpt")
    second = kl.ppo_update(trajs, adv)
    assert second["kl"] > 0
    for k, v in kl.reference.model.state_dict().items():  # the reference stayed the starting weights
        torch.testing.assert_close(v, start[k], rtol=0, atol=0)
    resumed = TorchTrainEngine(str(tiny_model_dir), lr=1e-2, n_minibatches=1, objective=Objective(kl_coef=0.5))
    resumed.load_checkpoint(tmp_path / "ckpt")
    again = resumed.ppo_update(trajs, adv)
    assert again["kl"] == pytest.approx(second["kl"], rel=1e-5)
    for k, v in resumed.weights().items():
        torch.testing.assert_close(v, kl.weights()[k], rtol=1e-5, atol=1e-7)
    with pytest.raises(FileNotFoundError, match="ppo.kl_coef=0"):
        plain.save_checkpoint(tmp_path / "plain")
        resumed.load_checkpoint(tmp_path / "plain")


def test_the_schedule_gives_the_documented_rate_and_a_resume_stays_on_its_curve(tiny_model_dir, ppo_batch, tmp_path):
    from areal_hpc.algo.schedule import lr_at
    from areal_hpc.config import load_config
    from areal_hpc.runtime.training.train_step import train_version

    # warm-up to the peak, then the decay's documented points (10 versions, 2 of warm-up: p = (v - 2) / 8)
    assert [lr_at(v, 1.0, "cosine", 2, 10) for v in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_at(6, 1.0, "cosine", 2, 10) == pytest.approx(0.5)  # p = 1/2
    assert lr_at(9, 1.0, "linear", 2, 10) == pytest.approx(1 / 8)  # the last update: p = 7/8, never 0
    assert lr_at(9, 1.0, "constant", 2, 10) == 1.0
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "trainer.lr=0.01",
            "trainer.lr_schedule=cosine",
            "trainer.warmup_versions=2",
            "trainer.versions=6",
            "ppo.n_minibatches=1",
            "ppo.drop_uniform_groups=false",
        ],
    )
    trajs, _ = ppo_batch
    a = TorchTrainEngine(str(tiny_model_dir), lr=99.0, n_minibatches=1)  # the schedule overrides the engine's
    rates = []
    for v in range(6):
        if v == 3:
            a.save_checkpoint(tmp_path / "v3")
        rates.append(train_version(a, trajs, cfg)[0]["lr"])
        assert a.optimizer.param_groups[0]["lr"] == rates[-1]
    assert rates == pytest.approx([lr_at(v, 0.01, "cosine", 2, 6) for v in range(6)])
    b = TorchTrainEngine(str(tiny_model_dir), lr=99.0, n_minibatches=1)
    b.load_checkpoint(tmp_path / "v3")
    assert [train_version(b, trajs, cfg)[0]["lr"] for _ in range(3)] == rates[3:]
    for k, v in b.weights().items():
        torch.testing.assert_close(v, a.weights()[k], rtol=1e-5, atol=1e-7)


def test_advantages_without_normalisation_or_over_the_batch_and_the_overlong_penalty():
    from areal_hpc.algo.advantages import batch_advantages, longest_answer, overlong_penalty

    r = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    g = np.repeat([0, 1], 4)
    none, _ = batch_advantages(r, g, "none", False)
    assert none.tolist() == r.tolist()
    # the batch's std, unbiased by default: sqrt(8 x 0.25 / 7) over 8 samples of mean 0.5; population: 0.5
    batch, _ = batch_advantages(r, g, "mean_std", False, scope="batch")
    np.testing.assert_allclose(batch, (r - 0.5) / (math.sqrt(2 / 7) + 1e-4), rtol=1e-6)
    pop, _ = batch_advantages(r, g, "mean_std", False, scope="batch", std="population")
    np.testing.assert_allclose(pop, (r - 0.5) / (0.5 + 1e-4), rtol=1e-6)
    group, _ = batch_advantages(r, g, "mean", False)
    np.testing.assert_allclose(group, r - np.repeat([0.25, 0.75], 4))
    # over two trainers: each holds one group, the statistics are the batch's (the sum stands in for the collective)
    other = np.array([4.0, r[4:].sum(), (r[4:] ** 2).sum()])
    half, _ = batch_advantages(r[:4], g[:4], "mean", False, scope="batch", sum_across_trainers=lambda x: x + other)
    np.testing.assert_allclose(half, r[:4] - 0.5)
    # DAPO's soft penalty: none up to 12 of 16 tokens, then linear to -penalty at 16
    np.testing.assert_allclose(overlong_penalty(np.array([5, 12, 14, 16]), 16, 4, 0.5), [0, 0, -0.25, -0.5])
    assert longest_answer(np.array([0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0])) == 4
