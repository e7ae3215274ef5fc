"""Algorithm core: decoupled PPO loss, loglinear approximation, advantages, staleness gate, packing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import decoupled_ppo_loss  # tests/ is on the path when pytest runs
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.advantages import group_advantages, informative_groups
from areal_hpc.algo.packing import _ffd_bin_count, balance_across_ranks, pack_microbatches
from areal_hpc.algo.ppo import loglinear_prox_logp
from areal_hpc.algo.staleness import StalenessGate


def reference_loss(logp, prox, behav, adv, mask, eps, cap, total):
    """Token-by-token transcription of docs/algorithm.md's formula, with python floats for the constants."""
    terms, kept = [], 0.0
    for t in range(len(logp)):
        w = float(torch.exp(prox[t] - behav[t]))
        m = float(mask[t])
        if cap is not None and w > cap:
            m = 0.0
        kept += m
        u = torch.exp(logp[t] - float(prox[t]))
        a = float(adv[t])
        terms.append(-w * torch.minimum(u * a, torch.clamp(u, 1 - eps, 1 + eps) * a) * m)
    denom = total if total is not None else max(kept, 1.0)  # capped tokens leave the mask
    return torch.stack(terms).sum() / denom


@pytest.mark.parametrize("cap,total", [(None, None), (2.0, None), (None, 37), (1.5, 50)])
def test_loss_matches_reference_with_gradients(cap, total):
    g = torch.Generator().manual_seed(0)
    n = 64
    behav = -torch.rand(n, generator=g) * 3
    prox = behav + 0.6 * torch.randn(n, generator=g)
    logp0 = prox + 0.3 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.2).float()

    a = logp0.clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(
        a, prox, behav, adv, mask, eps_clip=0.2, behav_imp_weight_cap=cap, total_loss_tokens=total
    )
    loss.backward()
    b = logp0.clone().requires_grad_(True)
    ref = reference_loss(b, prox, behav, adv, mask, 0.2, cap, total)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(a.grad, b.grad)
    assert 0 < stats["clip_frac"] < 1  # the random ratios straddle the clip range


def test_cap_masks_tokens():
    behav = torch.zeros(4)
    prox = torch.log(torch.tensor([0.5, 1.0, 3.0, 10.0]))  # behaviour weights 0.5, 1, 3, 10
    logp = prox.clone().requires_grad_(True)
    adv = torch.ones(4)
    mask = torch.ones(4)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=2.0)
    loss.backward()
    assert logp.grad[2] == 0 and logp.grad[3] == 0
    assert logp.grad[0] != 0 and logp.grad[1] != 0
    assert stats["capped_frac"] == pytest.approx(0.5)
    # the capped tokens also leave the normaliser: mean over the 2 kept tokens of -w*u*A
    assert float(loss.detach()) == pytest.approx(-(0.5 + 1.0) / 2)


@pytest.mark.parametrize("how", ["masked", "capped"])
@pytest.mark.parametrize("last_logp", [0.0, 100.0])  # 100: its ratio exp(logp - prox) overflows as well
def test_an_overflowing_masked_or_capped_token_leaves_every_gradient_finite(how, last_logp):
    # a token whose behaviour logprob is -1e4: its weight exp(prox - behav) overflows to inf in fp32; with a
    # negative advantage the unclipped branch is the one taken, so its backward meets 0 * inf
    logp = torch.tensor([-1.0, -2.0, -0.5, last_logp], requires_grad=True)
    prox = torch.tensor([-1.1, -2.1, -0.4, -1.0])
    behav = torch.tensor([-1.0, -2.0, -0.5, -1e4])
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0 if how == "masked" else 1.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=5.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), logp.grad
    assert logp.grad[3] == 0  # the token takes no part in the step
    # the other tokens' gradients are those of the loss without the token
    ref = logp.detach()[:3].clone().requires_grad_(True)
    ref_loss, _ = decoupled_ppo_loss(ref, prox[:3], behav[:3], adv[:3], torch.ones(3), behav_imp_weight_cap=5.0)
    ref_loss.backward()
    torch.testing.assert_close(logp.grad[:3], ref.grad)
    assert stats["capped_frac"] == (0.25 if how == "capped" else 0.0)


def test_on_policy_reduces_to_policy_gradient():
    g = torch.Generator().manual_seed(1)
    n = 32
    lp = -torch.rand(n, generator=g) * 2
    adv = torch.randn(n, generator=g)
    mask = torch.ones(n)
    logp = lp.clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(logp, lp, lp, adv, mask)
    loss.backward()
    # at ratio 1, d/dlogp of -A*exp(logp - logp_old) / n is -A/n: the REINFORCE gradient
    torch.testing.assert_close(logp.grad, -adv / n)
    torch.testing.assert_close(loss, -(adv.sum() / n))
    assert stats["clip_frac"] == 0 and stats["ratio_mean"] == pytest.approx(1.0)


def test_loglinear_prox():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    behav = torch.tensor([-3.0, -3.0, -3.0, -3.0])
    versions = torch.tensor([4, 3, 1, 5])
    prox = loglinear_prox_logp(logp, behav, versions, current_version=5)
    # gaps 1, 2, 4, 0 -> alpha 0, 1/2, 3/4, 0
    torch.testing.assert_close(prox, torch.tensor([-3.0, -2.0, -1.5, -3.0]))


def test_group_advantages_and_filter():
    r = np.array([1, 0, 0, 1, 1, 1, 0, 0, 0])
    g = np.array([0, 0, 0, 0, 1, 1, 2, 2, 2])
    a = group_advantages(r, g, "mean")
    np.testing.assert_allclose(a[:4], [0.5, -0.5, -0.5, 0.5])
    np.testing.assert_allclose(a[4:], 0)
    # the std of group 0 (1, 0, 0, 1): unbiased (the default) sqrt(1/3), over n - 1 = 3; population 0.5, over n
    s = group_advantages(r, g, "mean_std")
    np.testing.assert_allclose(s[:4], np.array([0.5, -0.5, -0.5, 0.5]) / (math.sqrt(1 / 3) + 1e-4), rtol=1e-6)
    p = group_advantages(r, g, "mean_std", std="population")
    np.testing.assert_allclose(p[:4], np.array([0.5, -0.5, -0.5, 0.5]) / (0.5 + 1e-4), rtol=1e-6)
    np.testing.assert_allclose(s[4:], 0)
    # a one-sample group: advantage 0 with either std, no NaN (its n - 1 is 0); over the batch too
    for std in ("unbiased", "population"):
        assert group_advantages(np.array([1.0]), np.array([0]), "mean_std", std=std).tolist() == [0.0]
        one = group_advantages(np.array([1.0]), np.array([0]), "mean_std", scope="batch", std=std)
        assert one.tolist() == [0.0]
    with pytest.raises(ValueError, match="ppo.adv_std"):
        group_advantages(r, g, "mean_std", std="sample")
    assert informative_groups(r, g).tolist() == [True] * 4 + [False] * 5
    with pytest.raises(ValueError, match="mean_std"):
        group_advantages(r, g, "median")


def test_staleness_gate_is_areals_rule():
    gate = StalenessGate(batch_prompts=4, eta=1)
    assert gate.capacity() == 8  # (0 + 1 + 1) * 4
    assert gate.admit(10) == 8 and gate.admit(1) == 0
    gate.finish(4)  # one batch ready, still v=0: no new room
    assert gate.capacity() == 0
    gate.set_version(1)  # the batch was trained
    assert gate.capacity() == 4
    sync = StalenessGate(batch_prompts=4, eta=0)
    assert sync.admit(100) == 4  # eta = 0: exactly one batch in flight
    gate.finish(4)
    assert gate.capacity() == 4
    gate.discard(1)  # a finished prompt dropped as too stale gives its slot back
    assert gate.capacity() == 5
    with pytest.raises(ValueError):
        gate.discard(100)
    capped = StalenessGate(batch_prompts=4, eta=8, max_running=3)
    assert capped.admit(100) == 3
    with pytest.raises(ValueError):
        capped.finish(5)


@pytest.mark.parametrize("eta,fifo", [(0, False), (0, True), (1, True), (3, True)])
def test_staleness_bound_holds_in_simulation(eta, fifo):
    """Admitted prompts are trained at most eta versions later when they finish in admission order;
    with eta = 0 it holds for any finishing order (the synchronous baseline). A slow prompt under
    eta >= 1 can outlive the bound: the scheduler drops such groups at batch assembly."""
    rng = np.random.default_rng(eta)
    B = 5
    gate = StalenessGate(batch_prompts=B, eta=eta)
    running, ready, admitted_at = [], [], {}
    next_id = 0
    for _ in range(400):
        for _ in range(gate.admit(int(rng.integers(1, 4)))):
            admitted_at[next_id] = gate.version
            running.append(next_id)
            next_id += 1
        assert gate.accepted + gate.running <= (gate.version + eta + 1) * B
        if running and rng.random() < 0.7:
            pid = running.pop(0 if fifo else int(rng.integers(len(running))))
            gate.finish(1)
            ready.append(pid)
        if len(ready) >= B:
            batch, ready = ready[:B], ready[B:]
            for pid in batch:
                assert gate.version - admitted_at[pid] <= eta
            gate.set_version(gate.version + 1)
    assert gate.version > 10


lengths_st = st.lists(st.integers(1, 300), min_size=0, max_size=120)


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 600))
def test_packing_properties(lengths, budget):
    mbs = pack_microbatches(lengths, budget)
    flat = [i for mb in mbs for i in mb]
    assert sorted(flat) == list(range(len(lengths)))  # nothing lost or duplicated
    for mb in mbs:
        assert sum(lengths[i] for i in mb) <= budget or len(mb) == 1
    fitting = [n for n in lengths if n <= budget]
    n_over = len(lengths) - len(fitting)
    assert len(mbs) <= _ffd_bin_count(fitting, budget) + n_over


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.sampled_from([5, 10, 200, 1000, 2000]), min_size=1, max_size=80), budget=st.integers(2000, 6000)
)
def test_packing_long_tailed_is_balanced(lengths, budget):
    mbs = pack_microbatches(lengths, budget)
    loads = [sum(lengths[i] for i in mb) for mb in mbs]
    # never less balanced than first-fit-decreasing's own assignment on the same lengths
    from areal_hpc.algo.packing import _ffd_assign

    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ffd_loads = [sum(lengths[i] for i in b) for b in _ffd_assign(order, lengths, budget)]
    assert max(loads) - min(loads) <= max(ffd_loads) - min(ffd_loads)


def test_packing_balances_loads():
    lengths = [100] * 10 + [10] * 10
    mbs = pack_microbatches(lengths, 400)
    loads = sorted(sum(lengths[i] for i in mb) for mb in mbs)
    assert len(mbs) == 3 and loads[-1] - loads[0] <= 100
    assert pack_microbatches([], 10) == []
    assert pack_microbatches([50, 5], 10) == [[1], [0]]
    with pytest.raises(ValueError):
        pack_microbatches([1], 0)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 500), min_size=1, max_size=64), n=st.integers(1, 6))
def test_balance_across_ranks(lengths, n):
    shares = balance_across_ranks(lengths, n)
    assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)  # greedy LPT bound


def test_balance_keeps_groups_together():
    lengths = [10, 12, 30, 31, 5, 6, 50, 60]
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    shares = balance_across_ranks(lengths, 2, groups)
    for s in shares:
        gs = {groups[i] for i in s}
        for g in gs:
            assert all(i in s for i in range(len(groups)) if groups[i] == g)


def test_branches_of_one_episode_share_its_advantage():
    # group 0: episode 0 (reward 1) split into two branches, episode 1 (reward 0): stats over the two episodes
    r = np.array([1.0, 1.0, 0.0, 1.0, 0.0])
    g = np.array([0, 0, 0, 1, 1])
    sample = np.array([0, 0, 1, 0, 1])
    a = group_advantages(r, g, "mean", sample_ids=sample)
    np.testing.assert_allclose(a, [0.5, 0.5, -0.5, 0.5, -0.5])
    s = group_advantages(r, g, "mean_std", sample_ids=sample)
    np.testing.assert_allclose(s, [s[3], s[3], s[4], s[3], s[4]], rtol=1e-6)  # as if each episode were one sample
    assert group_advantages(r, g, "mean")[0] == pytest.approx(1 / 3)  # without: the branches weigh twice
