"""The training forward: padding-free packing, chunked log-probabilities, activation checkpointing, bf16 compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_hpc.engines import forward
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.model import load_causal_lm

CPU = torch.device("cpu")


def _random_seqs(vocab: int, lengths, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n) for n in lengths]


def _reference(model, seqs, temperature):
    """Today's computation before this change: right padding, the full logits, one log_softmax."""
    mb = forward.padded(seqs, 0, CPU)
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float() / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    lp = logsm.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    zero = torch.zeros(1)
    return (
        [torch.cat([zero, lp[i, : len(s) - 1]]) for i, s in enumerate(seqs)],
        [torch.cat([zero, ent[i, : len(s) - 1]]) for i, s in enumerate(seqs)],
    )


def _packed_model(path):
    """The model as the trainer runs it: its attention keeps packed sequences apart."""
    model = load_causal_lm(path)
    assert forward.use_packed_attention(model, CPU) == forward.PACKED_SDPA
    return model


def _grads(model, loss) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("arch_dir", ["tiny_model_dir", "tiny_qwen_dir"])
def test_packed_and_padded_logprobs_agree_with_gradients(arch_dir, request):
    model = _packed_model(request.getfixturevalue(arch_dir))
    head = model.get_output_embeddings()
    vocab = model.config.vocab_size
    for seed, lengths in enumerate([(5, 17, 9, 2), (31, 3, 12), (8,)]):
        seqs = _random_seqs(vocab, lengths, seed)
        weights = [torch.randn(n) for n in lengths]  # a loss touching every position differently
        lp_packed, _ = forward.token_logprobs(model, head, forward.packed(seqs, CPU), 1.0, 1024)
        g_packed = _grads(model, sum((lp * w).sum() for lp, w in zip(lp_packed, weights)))
        lp_padded, _ = forward.token_logprobs(model, head, forward.padded(seqs, 0, CPU), 1.0, 1024)
        g_padded = _grads(model, sum((lp * w).sum() for lp, w in zip(lp_padded, weights)))
        for a, b in zip(lp_packed, lp_padded):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g_packed, g_padded, atol=1e-5, rtol=1e-4)


def test_no_attention_crosses_a_sequence_boundary(tiny_model_dir):
    model = _packed_model(tiny_model_dir)
    head = model.get_output_embeddings()
    seqs = _random_seqs(model.config.vocab_size, (6, 11, 7), seed=3)
    with torch.no_grad():
        before, _ = forward.token_logprobs(model, head, forward.packed(seqs, CPU))
        changed = [seqs[0], _random_seqs(model.config.vocab_size, (11,), seed=9)[0], seqs[2]]
        after, _ = forward.token_logprobs(model, head, forward.packed(changed, CPU))
    torch.testing.assert_close(before[0], after[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(before[2], after[2], atol=1e-6, rtol=0)  # it comes after the changed one
    assert not torch.allclose(before[1], after[1])
    mb = forward.packed(seqs, CPU)
    assert mb.padding == 0 and mb.position_ids[0].tolist()[:8] == [0, 1, 2, 3, 4, 5, 0, 1]


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_chunked_logprobs_and_entropy_equal_the_full_computation(tiny_qwen_dir, temperature):
    model = load_causal_lm(tiny_qwen_dir)
    head = model.get_output_embeddings()
    seqs = _random_seqs(model.config.vocab_size, (13, 4, 22), seed=1)
    with torch.no_grad():
        ref_lp, ref_ent = _reference(model, seqs, temperature)
        for chunk in (1, 5, 16, 4096):
            lp, ent = forward.token_logprobs(model, head, forward.packed(seqs, CPU), temperature, chunk)
            for a, b in zip(lp, ref_lp):
                torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
            for a, b in zip(ent, ref_ent):
                torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert all(float(e[1:].min()) > 0 for e in ref_ent)  # a real entropy, not zeros on both sides


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_loss_and_gradients_equal_the_full_computation(tiny_qwen_dir, temperature):
    # the training path: each chunk's gradient is taken in the forward; the reference keeps full logits
    seqs = _random_seqs(load_causal_lm(tiny_qwen_dir).config.vocab_size, (13, 4, 22, 9), seed=5)
    weights = torch.randn(sum(len(s) for s in seqs))

    def loss_fn(lp, index):  # a per-token loss, nonlinear in the log-probability as PPO's is
        return (weights[index] * torch.exp(lp).clamp(max=0.5) + 0.1 * lp).sum()

    ref_model = load_causal_lm(tiny_qwen_dir)
    ref_lp, ref_ent = _reference(ref_model, seqs, temperature)
    ref_loss = sum(
        loss_fn(lp[1:], torch.arange(1, len(lp)) + sum(len(x) for x in seqs[:i])) for i, lp in enumerate(ref_lp)
    )
    ref_grad = _grads(ref_model, ref_loss)
    model = _packed_model(tiny_qwen_dir)
    for chunk in (1, 7, 4096):
        loss, lps, ents = forward.chunked_loss(
            model, model.get_output_embeddings(), forward.packed(seqs, CPU), loss_fn, temperature, chunk
        )
        torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(_grads(model, loss), ref_grad, atol=1e-5, rtol=1e-4)
        for a, b in zip(lps, ref_lp):
            torch.testing.assert_close(a, b.detach(), atol=2e-6, rtol=1e-5)
        for a, b in zip(ents, ref_ent):
            torch.testing.assert_close(a, b.detach(), atol=2e-5, rtol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    grads = []
    for ckpt in (False, True):
        tr = TorchTrainEngine(str(tiny_model_dir), gradient_checkpointing=ckpt, seed=0)
        assert tr.model.is_gradient_checkpointing == ckpt
        seqs = _random_seqs(tr.model.config.vocab_size, (9, 14, 5), seed=2)
        grads.append(_grads(tr.model, tr._loss(seqs, lambda lp, index: (lp * index).sum())[0]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_bf16_compute_keeps_fp32_master_weights(tiny_model_dir):
    fp32 = TorchTrainEngine(str(tiny_model_dir), seed=0)
    seqs = _random_seqs(fp32.model.config.vocab_size, (9, 14), seed=4)
    bf16 = TorchTrainEngine(str(tiny_model_dir), bf16=True, seed=0, lr=1e-6, grad_clip=0.0)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    with torch.no_grad():
        a, b = fp32._token_logprobs(seqs), bf16._token_logprobs(seqs)
    assert all(x.dtype == torch.float32 for x in b)
    diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
    assert 1e-6 < diff < 0.1  # computed in bf16 (it differs), close to fp32
    # an update at a small learning rate lands in the fp32 weights; in bf16 it would round away
    before = {k: v.clone() for k, v in bf16.model.state_dict().items()}
    bf16._backward(bf16._loss(seqs, lambda lp, index: -lp.sum())[0], True)
    bf16._optimizer_step()
    after = bf16.model.state_dict()
    moved = torch.cat([(before[k] != after[k]).reshape(-1) for k in before])
    lost = torch.cat([(before[k].bfloat16() == after[k].bfloat16()).reshape(-1) for k in before])
    assert moved.float().mean() > 0.9
    assert (moved & lost).sum() > 0.9 * moved.sum()  # nearly every one of them is below bf16's resolution
    state = next(iter(bf16.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32


def test_ppo_step_reports_padding_and_entropy(tiny_model_dir, ppo_batch):
    trajs, adv = ppo_batch
    stats = {}
    for packing in (True, False):
        tr = TorchTrainEngine(str(tiny_model_dir), packing=packing, seed=0)
        stats[packing] = tr.ppo_update(trajs, adv)
    assert stats[True]["fwd_padding"] == 0 and stats[True]["fwd_positions"] > 0
    assert stats[False]["fwd_padding"] > 0  # the sampled lengths differ, so right padding wastes positions
    assert stats[True]["fwd_positions"] == stats[False]["fwd_positions"] - stats[False]["fwd_padding"]
    assert 0 < stats[True]["entropy"] == pytest.approx(stats[False]["entropy"], rel=1e-4)
    assert stats[True]["loss"] == pytest.approx(stats[False]["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("where", ["masked", "capped"])
def test_an_overflowing_behaviour_logprob_leaves_the_trained_weights_finite(tiny_model_dir, ppo_batch, where):
    import dataclasses

    trajs, adv = ppo_batch
    t = trajs[0]
    behav = t.behav_logprobs.copy()
    k = int(np.flatnonzero(t.loss_mask == (0 if where == "masked" else 1))[-1])
    behav[k] = -1e4  # exp(prox - behav) overflows; capped: it is over the cap, so out of the loss
    bad = [dataclasses.replace(t, behav_logprobs=behav), *trajs[1:]]
    tr = TorchTrainEngine(str(tiny_model_dir), behav_imp_weight_cap=5.0, seed=0, lr=1e-3)
    stats = tr.ppo_update(bad, adv)
    assert np.isfinite(stats["grad_norm"]) and np.isfinite(stats["loss"])
    assert all(torch.isfinite(v).all() for v in tr.weights().values())
