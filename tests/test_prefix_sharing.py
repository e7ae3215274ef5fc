"""Shared prefixes computed once: the layout, the packing by computed tokens, and the same update as unshared."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_hpc.algo import prefix_tree
from areal_hpc.algo.ppo import Objective
from areal_hpc.algo.prefix_tree import pack_shared, prefix_layout, shares_a_prefix
from areal_hpc.engines import forward
from areal_hpc.engines.batching import Batching
from areal_hpc.engines.lora import LoraSpec
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.types import Trajectory


def _tokens(rng, n, vocab=50):
    return rng.integers(1, vocab, n)


def _tree_seqs(seed=0):
    """A prefix shared by all (40), a longer one shared by some (40 + 20), a duplicate, a sequence that is
    another's prefix, a lone sequence, and two that share fewer tokens than the threshold."""
    rng = np.random.default_rng(seed)
    p, q = _tokens(rng, 40), _tokens(rng, 20)
    seqs = [np.concatenate([p, _tokens(rng, n)]) for n in (10, 9, 1)]
    seqs += [np.concatenate([p, q, _tokens(rng, n)]) for n in (4, 6)]
    seqs += [_tokens(rng, 12), p[:30].copy(), seqs[0].copy()]
    short = _tokens(rng, 3)
    seqs += [np.concatenate([short, _tokens(rng, n)]) for n in (7, 8)]
    return seqs


def test_the_layout_holds_every_sequence_and_lays_each_long_shared_prefix_once():
    seqs = _tree_seqs()
    layout = prefix_layout(seqs, min_shared=8)
    offsets = layout.offsets()
    row = np.concatenate([seqs[s.seq][s.start : s.end] for s in layout.segments])
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(row[layout.positions(i, offsets)], s)  # its tokens, in order
    # laid once: p's first 30 tokens (7 hold them; all of seq 6), p's last 10 (6), q (2), seq 0's 10 more (its copy)
    unshared = sum(len(s) for s in seqs)
    assert layout.computed == unshared - (6 * 30 + 5 * 10 + 1 * 20 + 1 * 10)
    # the 3-token common start of the last two is under the threshold: each keeps its own copy
    assert all(layout.segments[layout.leaf[i]].parent == -1 for i in (8, 9))
    # a lone sequence, or none sharing: the plain packed row
    mb = forward.shared(seqs[5:6], prefix_layout(seqs[5:6], 8), torch.device("cpu"))
    assert mb.tree is None and mb.positions == len(seqs[5])
    with pytest.raises(ValueError, match="min_shared"):
        prefix_layout(seqs, 0)


def test_packing_counts_computed_tokens_and_splits_a_group_keeping_its_prefix():
    rng = np.random.default_rng(1)
    preamble = _tokens(rng, 400)
    group = [np.concatenate([preamble, _tokens(rng, 30)]) for _ in range(8)]  # 8 x 430 unshared, 640 as a tree
    others = [_tokens(rng, 100) for _ in range(3)]
    seqs = group + others
    # 640 + 300 computed tokens: one micro-batch, where 3,740 unshared tokens would take four
    assert pack_shared(seqs, 1000, 32) == [list(range(11))]
    # a budget under the group's tree: the group is split, each part with its own copy of the preamble
    mbs = pack_shared(seqs, 560, 32)
    assert sorted(i for mb in mbs for i in mb) == list(range(11))
    for mb in mbs:
        assert prefix_layout([seqs[i] for i in mb], 32).computed <= 560
    parts = [mb for mb in mbs if any(i < 8 for i in mb)]
    assert len(parts) >= 2 and all(sum(i < 8 for i in mb) >= 2 for mb in parts)  # shared within each part


def _batch(vocab: int, seed: int = 3):
    """Three groups whose samples share their 40-token prompt, one group sharing 12 answer tokens more; one group's
    answers are longer than the prompt (the attention takes another path for those)."""
    rng = np.random.default_rng(seed)
    trajs = []
    for g in range(3):
        prompt = rng.integers(1, vocab, 40)
        common = rng.integers(1, vocab, 12)
        for s in range(4):
            answer = rng.integers(1, vocab, 45 + s if g == 1 else 6 + 3 * s)  # longer than the prompt, or shorter
            if g == 2 and s < 3:
                answer = np.concatenate([common, answer])
            ids = np.concatenate([prompt, answer]).astype(np.int32)
            mask = np.zeros(len(ids), np.uint8)
            mask[40:] = 1
            behav = np.where(mask > 0, -rng.uniform(0.5, 4.0, len(ids)), 0).astype(np.float32)
            versions = np.where(mask > 0, 0, -1).astype(np.int32)
            trajs.append(Trajectory(g, g, s, ids, behav, versions, mask, 40))
    return trajs, np.linspace(-1, 1, len(trajs)).astype(np.float32)


@pytest.mark.parametrize(
    "setting",
    [
        # a micro-batch under one group's tree: groups are split, each part keeping its prompt
        {"max_tokens_per_mb": 64, "objective": Objective(behav_cap=2.0, kl_coef=0.1)},
        {"gradient_checkpointing": True, "objective": Objective(entropy_coef=0.01), "logprob_chunk_tokens": 7},
        {"lora": LoraSpec(4, 8.0), "objective": Objective(kl_coef=0.1)},
    ],
    ids=["split_groups_kl", "checkpointing_entropy", "lora_kl"],
)
def test_a_version_with_shared_prefixes_updates_the_weights_as_unshared(tiny_qwen_dir, setting):
    from transformers import AutoConfig

    trajs, adv = _batch(AutoConfig.from_pretrained(tiny_qwen_dir).vocab_size)
    weights, stats = [], []
    for share in (False, True):
        tr = TorchTrainEngine(
            str(tiny_qwen_dir),
            lr=0.1,
            optimizer="sgd",  # linear in the gradient: the weights differ only by what the gradient does
            weight_decay=0.0,
            grad_clip=0.0,
            n_minibatches=2,
            seed=0,
            share_prefixes=share,
            **setting,
        )
        minibatches = [[i for i, t in enumerate(trajs) if t.group_id in gs] for gs in ({0, 2}, {1})]  # whole groups
        tr.ppo_update(trajs, adv, minibatches)  # version 0 -> 1: the KL reference is version 0
        stats.append(tr.ppo_update(trajs, adv, minibatches))  # the recompute and the reference see moved weights
        weights.append(tr.weights())
    for k, v in weights[0].items():  # four SGD steps at lr 0.1: the gradients agree to 1e-5
        torch.testing.assert_close(weights[1][k], v, atol=1e-6, rtol=0, msg=k)
    off, on = stats
    for k in ("loss", "grad_norm", "clip_frac", "offpolicy_k3", "kl", "entropy"):
        if k in off:
            assert on[k] == pytest.approx(off[k], rel=1e-4, abs=1e-6), k
    assert off["train_tokens_computed"] == off["train_tokens_unshared"] == on["train_tokens_unshared"]
    # every forward of the version (recompute, reference, two minibatch steps) computed each prompt once (split
    # groups: once per part)
    saved = 1 - on["train_tokens_computed"] / on["train_tokens_unshared"]
    assert saved > (0.05 if "max_tokens_per_mb" in setting else 0.4), saved


def test_shares_a_prefix_says_exactly_when_the_layout_lays_something_down_once():
    rng = np.random.default_rng(4)
    for k in range(60):
        head = _tokens(rng, int(rng.integers(0, 12)), vocab=4)  # a small vocabulary: chance common runs too
        seqs = [np.concatenate([head, _tokens(rng, int(rng.integers(0, 10)), vocab=4)]) for _ in range(5)]
        layout = prefix_layout(seqs, min_shared=6)
        laid_once = len(layout.segments) < len(seqs) or any(s.parent >= 0 for s in layout.segments)
        assert shares_a_prefix(seqs, 6) == laid_once, k
    assert shares_a_prefix(_tree_seqs(), 8) and not shares_a_prefix(_tree_seqs()[8:], 8)
    with pytest.raises(ValueError, match="min_shared"):
        shares_a_prefix(_tree_seqs(), 0)


def _sharing_nothing(vocab: int, seed: int = 5):
    """The demo's shape: groups of 4 answers to a 7-token prompt, under the 32-token threshold, and answers of
    varied length (two of them longer than the threshold, all different)."""
    rng = np.random.default_rng(seed)
    trajs = []
    for g in range(3):
        prompt = rng.integers(1, vocab, 7)
        for s in range(4):
            ids = np.concatenate([prompt, rng.integers(1, vocab, 5 + 9 * s + g)]).astype(np.int32)
            mask = (np.arange(len(ids)) >= 7).astype(np.uint8)
            behav = np.where(mask > 0, -rng.uniform(0.5, 4.0, len(ids)), 0).astype(np.float32)
            trajs.append(Trajectory(g, g, s, ids, behav, np.where(mask > 0, 0, -1).astype(np.int32), mask, 7))
    return trajs, np.linspace(-1, 1, len(trajs)).astype(np.float32)


def test_a_micro_batch_sharing_nothing_takes_the_plain_packed_path(tiny_qwen_dir, monkeypatch):
    """With share_prefixes on and nothing to share, the micro-batches are those of share_prefixes off: packed by
    length, no prefix tree built (its functions are never called), the same inputs, the same update bit for bit."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_qwen_dir).vocab_size
    trajs, adv = _sharing_nothing(vocab)
    seqs = [t.input_ids for t in trajs]
    # the contrast: a batch that shares its prompts takes the tree path
    sharing = [t.input_ids for t in _batch(vocab)[0]]
    assert Batching(4096).shares(sharing) and Batching(4096).build(sharing).tree is not None
    assert not Batching(4096, share_prefixes=False).shares(sharing)

    def no_tree(*args, **kwargs):
        raise AssertionError("a prefix tree built for a micro-batch that shares nothing")

    monkeypatch.setattr(prefix_tree, "prefix_layout", no_tree)
    monkeypatch.setattr(prefix_tree, "pack_shared", no_tree)
    on, off = Batching(64, share_prefixes=True), Batching(64, share_prefixes=False)
    assert not on.shares(seqs)
    plan = on.plan(seqs)
    assert plan == off.plan(seqs) and len(plan) > 1  # packed by length, as with sharing off
    for mb in plan:
        a, b = on.build([seqs[i] for i in mb]), off.build([seqs[i] for i in mb])
        assert a.tree is None and a.token_pos is None and "prefix_tree" not in a.model_kwargs()
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
    assert on.counts() == off.counts()

    weights, stats = [], []
    for share in (False, True):
        tr = TorchTrainEngine(
            str(tiny_qwen_dir),
            lr=0.1,
            optimizer="sgd",
            max_tokens_per_mb=64,
            seed=0,
            n_minibatches=2,
            share_prefixes=share,
        )
        stats.append(tr.ppo_update(trajs, adv, [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7]]))
        weights.append(tr.weights())
    for k, v in weights[0].items():
        assert torch.equal(weights[1][k], v), k
    off_stats, on_stats = stats
    for k in ("loss", "grad_norm", "train_tokens_computed", "train_tokens_unshared"):
        assert on_stats[k] == off_stats[k], k
    assert on_stats["train_tokens_computed"] == on_stats["train_tokens_unshared"]
