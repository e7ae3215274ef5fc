"""Engine contract tests: the step-driven generation engines (torch, vLLM); torch training vs transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from request_helpers import output_trajectory, sample_request

from areal_hpc.engines.base import generate
from areal_hpc.engines.torch_gen import TorchGenerationEngine
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.model import load_causal_lm, load_tokenizer
from areal_hpc.types import GenRequest

PROMPTS = ["07+35=", "1+2=", "99+99=", "50+5="]
GEN_ENGINES = ["torch", "vllm"]  # vLLM: its CPU build, in-process (env/setup.sh installs it)


def _requests(tok, max_new=12, prompts=PROMPTS, greedy=False):
    return [GenRequest(f"{i}:0", tok.encode(p), max_new, greedy=greedy) for i, p in enumerate(prompts)]


@pytest.fixture
def make_gen():
    """Builds generation engines by name and closes them after the test (vLLM holds an engine core)."""
    made = []

    def make(kind, path, **kw):
        if kind == "torch":
            eng = TorchGenerationEngine(str(path), **kw)
        else:
            from areal_hpc.engines.vllm_gen import VLLMGenerationEngine

            eng = VLLMGenerationEngine(str(path), **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def _reference_logprobs(model, o, temperature=1.0):
    """log p(token) of each output token under softmax(logits / T) of a full transformers forward."""
    seq = torch.tensor([o.prompt_ids + o.output_ids])
    with torch.no_grad():
        logits = model(seq).logits[0, :-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None]).squeeze(-1)[len(o.prompt_ids) - 1 :].numpy()


def _greedy_reference(model, tok, prompt, max_new=12):
    ids = torch.tensor([tok.encode(prompt)])
    ref = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return ref[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("kind", GEN_ENGINES)
@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_qwen_dir"])
def test_greedy_matches_transformers(request, model_fixture, kind, make_gen):
    path = request.getfixturevalue(model_fixture)
    tok = load_tokenizer(path)
    outs = generate(make_gen(kind, path), _requests(tok, greedy=True))
    ref_model = load_causal_lm(path).eval()
    for p, o in zip(PROMPTS, outs):
        assert o.output_ids == _greedy_reference(ref_model, tok, p)
        assert o.finish_reason == ("stop" if o.output_ids[-1] == tok.eos_token_id else "length")


@pytest.mark.parametrize("kind", GEN_ENGINES)
def test_logprobs_match_full_forward(tiny_model_dir, kind, make_gen):
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir).eval()
    for temperature in (1.0, 0.7):
        outs = generate(make_gen(kind, tiny_model_dir, temperature=temperature, seed=3), _requests(tok))
        assert sum(len(o.output_ids) for o in outs) > 8
        for o in outs:
            np.testing.assert_allclose(o.output_logprobs, _reference_logprobs(model, o, temperature), atol=1e-4)
            assert o.output_versions == [0] * len(o.output_ids)


def _step_until(eng, ids, limit=1000):
    """Step until every id is back; returns id -> (output, the step it came back in, counted from 1)."""
    got, k = {}, 0
    while not set(ids) <= set(got):
        k += 1
        assert k <= limit, "requests never finished"
        for o in eng.step():
            got[o.request_id] = (o, k)
    return got


@pytest.mark.parametrize("kind", GEN_ENGINES)
def test_requests_join_mid_flight_and_leave_in_the_step_they_finish(tiny_model_dir, kind, make_gen):
    tok = load_tokenizer(tiny_model_dir)
    eng = make_gen(kind, tiny_model_dir, seed=0)
    eng.ignore_eos = True  # lengths are exactly max_new_tokens, so the finishing step is known
    running = [GenRequest(f"long{i}", tok.encode(p), 40) for i, p in enumerate(PROMPTS[:3])]
    eng.add(running)
    for _ in range(5):
        assert eng.step() == []
    assert eng.num_running == 3
    # a request added now is prefilled and gets its first (here: only) token in the very next step
    eng.add([GenRequest("one", tok.encode("1+2="), 1)])
    assert [o.request_id for o in eng.step()] == ["one"]
    joined = GenRequest("joined", tok.encode("50+5="), 20, greedy=True)
    eng.add([joined])
    got = _step_until(eng, ["joined"] + [r.request_id for r in running])
    assert got["joined"][1] == 20  # back in the step that sampled its 20th token
    assert all(got[r.request_id][1] == 40 - 6 for r in running)  # 40 tokens: 6 steps above, 34 here
    assert all(len(got[r.request_id][0].output_ids) == 40 for r in running)
    assert eng.num_running == 0 and eng.num_waiting == 0
    # a greedy request that joined a running batch answers exactly as it does alone
    (solo,) = generate(eng, [GenRequest("solo", joined.prompt_ids, 20, greedy=True)])
    assert got["joined"][0].output_ids == solo.output_ids
    # no budget left: it finishes without sampling, handed back by the next step, and the blocking call returns it
    (empty,) = generate(eng, [GenRequest("empty", joined.prompt_ids, 0)])
    assert len(empty.output_ids) == 0 and empty.finish_reason == "length"


def test_slot_cache_keeps_every_row_exact_as_rows_come_and_go(tiny_model_dir):
    # the torch engine's slot cache: rows of very different lengths join a running batch (a joiner longer
    # than the window moves it; more rows than slots grow them), finished rows' slots are refilled by the
    # last row; every greedy answer and its logprobs stay those of the request decoded alone
    tok = load_tokenizer(tiny_model_dir)
    eng = TorchGenerationEngine(str(tiny_model_dir), seed=0, max_num_seqs=24)
    eng.ignore_eos = True
    base = tok.encode("07+35=")
    # three long-running rows with short prompts first, then one joiner per step with prompts of 6 to 30
    # tokens (longer than the window: it moves), up to 12 rows at once (more than the first 8 slots); a
    # long row decoded alone runs past its first buffer's end, so the reference moves its window too
    reqs = [GenRequest(f"long{i}", base, 70, greedy=True) for i in range(3)]
    reqs += [GenRequest(f"r{i}", base * (1 + (7 * i) % 5), 3 + (5 * i) % 11, greedy=True) for i in range(20)]
    got = {}
    eng.add(reqs[:3])
    for i in range(3, len(reqs)):
        got.update({o.request_id: o for o in eng.step()})
        eng.add([reqs[i]])  # one joiner per step, while earlier rows finish at varied steps
    while eng.num_running or eng.num_waiting:
        got.update({o.request_id: o for o in eng.step()})
    assert sorted(got) == sorted(r.request_id for r in reqs)
    alone = TorchGenerationEngine(str(tiny_model_dir), seed=0)
    alone.ignore_eos = True
    for r in reqs:
        (solo,) = generate(alone, [r])
        assert got[r.request_id].output_ids == solo.output_ids, r.request_id
        np.testing.assert_allclose(got[r.request_id].output_logprobs, solo.output_logprobs, atol=1e-4)


@pytest.mark.parametrize("kind", GEN_ENGINES)
def test_interrupt_then_resume_continues_with_new_version(tiny_model_dir, kind, make_gen):
    tok = load_tokenizer(tiny_model_dir)
    eng = make_gen(kind, tiny_model_dir, seed=0)
    eng.ignore_eos = True  # sample to max_new_tokens, so the interrupt lands mid-sequence
    reqs = _requests(tok, max_new=300)
    eng.add(reqs)
    for _ in range(5):
        eng.step()
    with pytest.raises(RuntimeError, match="in flight"):
        eng.update_weights(load_causal_lm(tiny_model_dir).state_dict(), version=1)  # never under running requests
    partial = {o.request_id: o for o in eng.interrupt()}
    assert eng.num_running == 0 and sorted(partial) == sorted(r.request_id for r in reqs)
    assert all(o.finish_reason == "abort" and len(o.output_ids) == 5 for o in partial.values())

    ref = load_causal_lm(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # through the model's parameters, so tied weights stay tied
        for p in ref.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    eng.pause()
    eng.update_weights(ref.state_dict(), version=1)
    eng.resume()
    # an interrupted output carries its request: the caller resumes it without a table of its own
    resumed = generate(eng, [partial[r.request_id].request.resumed(partial[r.request_id]) for r in reqs])
    eng.ignore_eos = False
    for o in resumed:
        p = partial[o.request_id]
        k = len(p.output_ids)
        assert o.output_ids[:k] == p.output_ids and len(o.output_ids) == 300
        assert o.output_versions == [0] * k + [1] * (300 - k)
        assert o.output_logprobs[:k] == p.output_logprobs
        assert o.finish_reason == "length"
        # the resumed tokens' logprobs are those of the new weights on prompt + partial
        np.testing.assert_allclose(o.output_logprobs[k:], _reference_logprobs(ref, o)[k:], atol=1e-4)


def _perturbed(path, seed=1):
    """The model at `path` with every weight moved a little (new weights for a load)."""
    model = load_causal_lm(path).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # through the model's parameters, so tied weights stay tied
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model


def _kept_kv_reference(old, new, o, k):
    """Logprobs of output tokens k.. when the KV cache of everything fed before a load (prompt + the first
    k-1 output tokens: the k-th was sampled, not yet fed) came from `old` and the rest from `new`."""
    seq = o.prompt_ids + o.output_ids
    cut = len(o.prompt_ids) + k - 1
    with torch.no_grad():
        past = old(torch.tensor([seq[:cut]]), use_cache=True).past_key_values
        logits = new(torch.tensor([seq[cut:-1]]), past_key_values=past, use_cache=True).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[cut + 1 :])[:, None]).squeeze(-1).numpy()


@pytest.mark.parametrize("kind", GEN_ENGINES)
def test_keep_kv_load_goes_on_over_the_cache_without_a_second_prefill(tiny_model_dir, kind, make_gen):
    tok = load_tokenizer(tiny_model_dir)
    eng = make_gen(kind, tiny_model_dir, seed=0)
    eng.ignore_eos = True
    # a prompt longer than vLLM's 128-token CPU KV block, so its prefix cache could serve it
    long_prompt = tok.encode("12+34=" * 30)
    reqs = _requests(tok, max_new=40) + [GenRequest("long:0", long_prompt, 40)]
    eng.add(reqs)
    for _ in range(5):
        eng.step()
    prefilled = eng.prefill_tokens
    assert prefilled == sum(len(r.prompt_ids) for r in reqs)  # each prompt once (nothing cached yet)
    old, new = load_causal_lm(tiny_model_dir).eval(), _perturbed(tiny_model_dir)
    eng.update_weights(new.state_dict(), version=1, keep_kv=True)  # between two steps, all five running
    assert eng.num_running == len(reqs)
    got = {o.request_id: o for o, _ in _step_until(eng, [r.request_id for r in reqs]).values()}
    assert eng.prefill_tokens == prefilled  # nothing prefilled again
    for o in got.values():
        assert o.finish_reason == "length" and o.output_versions == [0] * 5 + [1] * 35
        # the new weights over the cache computed before the load
        np.testing.assert_allclose(o.output_logprobs[5:], _kept_kv_reference(old, new, o, 5), atol=1e-4)
        assert not np.allclose(o.output_logprobs[5:], _reference_logprobs(new, o)[5:], atol=1e-4)
    # a request added after the load is computed by the new weights only, though its prompt's blocks were
    # cached under the old ones while the long request ran
    (late,) = generate(eng, [GenRequest("late:0", long_prompt, 8)])
    assert late.output_versions == [1] * 8
    np.testing.assert_allclose(late.output_logprobs, _reference_logprobs(new, late), atol=1e-4)
    assert eng.prefill_tokens > prefilled


@pytest.mark.parametrize("kind", GEN_ENGINES)
def test_finished_requests_stop_costing_compute(tiny_model_dir, kind, make_gen):
    tok = load_tokenizer(tiny_model_dir)
    eng = make_gen(kind, tiny_model_dir, max_num_seqs=3)
    eng.ignore_eos = True
    widths = []
    if kind == "torch":  # the batch width of every forward pass
        real = eng.model.forward
        eng.model.forward = lambda *a, **k: (widths.append(k["input_ids"].shape[0]), real(*a, **k))[1]
    eng.add([GenRequest(f"r{i}", tok.encode(PROMPTS[i % 4]), n) for i, n in enumerate([2, 4, 8, 3])])
    running = []
    while eng.num_running or eng.num_waiting:
        eng.step()
        running.append(eng.num_running)
    # capacity 3: the 4th request waits for the first free slot; finished rows leave the batch at once
    assert max(running) == 3 and running[-4:] == [1, 1, 1, 0], running
    if kind == "torch":
        # step 1 prefills r0-r2; step 2 decodes 3 (r0 done) and prefills r3 into the freed slot; steps 3-4
        # decode 3 (r1, r3 done at step 4); steps 5-8 decode r2 alone
        assert running == [3, 3, 3, 1, 1, 1, 1, 0], running
        assert widths == [3, 3, 1, 3, 3, 1, 1, 1, 1], widths


@pytest.mark.parametrize("kind", GEN_ENGINES)
def test_weight_update_changes_outputs_and_matches_the_trainers_export(tiny_model_dir, tmp_path, kind, make_gen):
    tok = load_tokenizer(tiny_model_dir)
    eng = make_gen(kind, tiny_model_dir)
    before = generate(eng, _requests(tok, greedy=True))
    tr = TorchTrainEngine(str(tiny_model_dir))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a large move, so greedy outputs surely change
        for p in tr.model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    eng.update_weights(tr.weights(), version=7)
    after = generate(eng, _requests(tok, greedy=True))
    assert [o.output_ids for o in before] != [o.output_ids for o in after]
    assert all(v == 7 for o in after for v in o.output_versions)
    # what the engine now computes is what transformers computes from the trainer's exported folder
    exported = load_causal_lm(tr.export_hf(tmp_path / "export")).eval()
    for p, o in zip(PROMPTS, after):
        assert o.output_ids == _greedy_reference(exported, tok, p)
    for o in generate(eng, _requests(tok)):
        np.testing.assert_allclose(o.output_logprobs, _reference_logprobs(exported, o), atol=1e-4)
    with pytest.raises(RuntimeError):
        eng.update_weights({"not.a.weight": torch.zeros(1)}, version=8)


def _trajs(tok, gen, n=16):
    reqs = [GenRequest(sample_request(i // 4, i % 4), tok.encode(PROMPTS[i % 4]), 6) for i in range(n)]
    outs = generate(gen, reqs)
    return [output_trajectory(o, o.request_id.episode.group_id, float(i % 2)) for i, o in enumerate(outs)]


def test_train_logprobs_match_generation(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    gen = TorchGenerationEngine(str(tiny_model_dir), seed=1)
    trajs = _trajs(tok, gen)
    tr = TorchTrainEngine(str(tiny_model_dir), max_tokens_per_mb=40)
    lps = tr.compute_logprobs([t.input_ids for t in trajs])
    for t, lp in zip(trajs, lps):
        m = t.loss_mask.astype(bool)
        np.testing.assert_allclose(lp[m], t.behav_logprobs[m], atol=1e-4)


def test_ppo_update_moves_towards_positive_advantage(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    gen = TorchGenerationEngine(str(tiny_model_dir), seed=2)
    trajs = _trajs(tok, gen)
    adv = np.array([1.0 if i % 2 else -1.0 for i in range(len(trajs))], np.float32)
    tr = TorchTrainEngine(str(tiny_model_dir), lr=1e-3, n_minibatches=2, max_tokens_per_mb=32)
    before = tr.compute_logprobs([t.input_ids for t in trajs])
    stats = tr.ppo_update(trajs, adv)
    after = tr.compute_logprobs([t.input_ids for t in trajs])
    assert tr.version == 1 and np.isfinite(stats["loss"])
    delta = [float((a - b)[t.loss_mask.astype(bool)].sum()) for a, b, t in zip(after, before, trajs)]
    assert np.mean([d for d, a in zip(delta, adv) if a > 0]) > np.mean([d for d, a in zip(delta, adv) if a < 0])


def test_checkpoint_restore_gives_same_next_step(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    gen = TorchGenerationEngine(str(tiny_model_dir), seed=4)
    trajs = _trajs(tok, gen)
    adv = np.linspace(-1, 1, len(trajs)).astype(np.float32)
    a = TorchTrainEngine(str(tiny_model_dir), lr=1e-3, n_minibatches=2)
    a.ppo_update(trajs, adv)
    a.save_checkpoint(tmp_path / "ckpt")
    rng_after_save = torch.rand(3)
    b = TorchTrainEngine(str(tiny_model_dir), lr=1e-3, n_minibatches=2)
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.version == 1
    torch.testing.assert_close(torch.rand(3), rng_after_save)  # RNG restored too
    a.ppo_update(trajs, adv)
    b.ppo_update(trajs, adv)
    for (k, va), vb in zip(a.weights().items(), b.weights().values()):
        torch.testing.assert_close(va, vb, msg=k)


def test_export_hf_loads_in_transformers_and_generation_engine(tiny_model_dir, tmp_path):
    tr = TorchTrainEngine(str(tiny_model_dir))
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(0.1)
    out = tr.export_hf(tmp_path / "export")
    eng = TorchGenerationEngine(str(out))
    for (k, v), w in zip(tr.weights().items(), eng.state_dict().values()):
        torch.testing.assert_close(v, w, msg=k)
    assert load_tokenizer(out).encode("1+2=") == load_tokenizer(tiny_model_dir).encode("1+2=")


@pytest.mark.parametrize("prox,cap", [("loglinear", None), ("recompute", 1.5), ("loglinear", 2.0)])
def test_ppo_update_variants_run(tiny_model_dir, prox, cap):
    tok = load_tokenizer(tiny_model_dir)
    gen = TorchGenerationEngine(str(tiny_model_dir), seed=5)
    trajs = _trajs(tok, gen)
    for t in trajs[:8]:  # pretend half the tokens came from an older policy
        t.versions[t.prompt_len :] = -3
    tr = TorchTrainEngine(str(tiny_model_dir), lr=1e-3, prox=prox, behav_imp_weight_cap=cap)
    tr.version = 2
    before = {k: v.clone() for k, v in tr.weights().items()}
    stats = tr.ppo_update(trajs, np.linspace(-1, 1, len(trajs)).astype(np.float32))
    assert tr.version == 3 and all(np.isfinite(v) for v in stats.values())
    assert any(not torch.equal(before[k], v) for k, v in tr.weights().items())


def _dp_worker(rank, world, port, model_dir, trajs, adv, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from areal_hpc.algo.packing import balance_across_ranks

    shares = balance_across_ranks([len(t.input_ids) for t in trajs], world)
    # uneven shares (the same on both ranks): rank 1 gets more micro-batches than rank 0
    shares[1], shares[0] = shares[1] + shares[0][:3], shares[0][3:]
    mine = shares[rank]
    tr = TorchTrainEngine(model_dir, lr=1e-3, n_minibatches=1, max_tokens_per_mb=24)
    tr.optimizer = torch.optim.SGD(
        tr.model.parameters(), lr=0.1
    )  # linear in the gradient: Adam's sign-like first step would amplify float noise
    tr.ppo_update([trajs[i] for i in mine], adv[mine])
    torch.save(tr.weights(), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_trainers_match_one(tiny_model_dir, tmp_path):
    import socket

    import torch.multiprocessing as mp

    tok = load_tokenizer(tiny_model_dir)
    trajs = _trajs(tok, TorchGenerationEngine(str(tiny_model_dir), seed=6))
    adv = np.linspace(-1, 1, len(trajs)).astype(np.float32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _dp_worker, args=(2, port, str(tiny_model_dir), trajs, adv, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    single = TorchTrainEngine(str(tiny_model_dir), lr=1e-3, n_minibatches=1)
    single.optimizer = torch.optim.SGD(single.model.parameters(), lr=0.1)
    start = {k: v.clone() for k, v in single.weights().items()}
    single.ppo_update(trajs, adv)
    w0, w1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    for k, v in single.weights().items():
        torch.testing.assert_close(w0[k], w1[k], rtol=0, atol=0)  # ranks stay identical
        torch.testing.assert_close(w0[k], v, rtol=1e-4, atol=1e-6)  # and equal the single trainer
    assert any(not torch.equal(start[k], v) for k, v in single.weights().items())


def test_loglinear_prox_treats_current_weights_as_the_proximal_policy(tiny_model_dir, monkeypatch):
    import areal_hpc.engines.policy_step as policy_step

    tok = load_tokenizer(tiny_model_dir)
    trajs = _trajs(tok, TorchGenerationEngine(str(tiny_model_dir), seed=7))
    seen = []
    real = policy_step.loglinear_prox_logp

    def spy(logp, behav, versions, current_version):
        seen.append(current_version)
        return real(logp, behav, versions, current_version)

    monkeypatch.setattr(policy_step, "loglinear_prox_logp", spy)
    tr = TorchTrainEngine(str(tiny_model_dir), prox="loglinear")
    tr.version = 4
    tr.ppo_update(trajs, np.linspace(-1, 1, len(trajs)).astype(np.float32))
    # the weights being trained become version 5; tokens of version 4 are on-policy (alpha = 0)
    assert seen and set(seen) == {5}


def test_plain_ppo_takes_the_ratio_to_the_behaviour_policy_without_a_recompute(tiny_model_dir, ppo_batch):
    """ppo.decoupled=false: the paper's baseline. Behaviour logprobs 0.5 below the policy's: plain PPO's ratio
    is exp(0.5) from the first step; the decoupled objective's ratio starts at 1, the 0.5 going to its weight."""
    import dataclasses

    from areal_hpc.engines.torch_train import TorchTrainEngine

    trajs, adv = ppo_batch
    lower = [dataclasses.replace(t, behav_logprobs=t.behav_logprobs - 0.5 * t.loss_mask) for t in trajs]
    stats = {}
    for decoupled in (False, True):
        tr = TorchTrainEngine(str(tiny_model_dir), n_minibatches=1, decoupled=decoupled, behav_imp_weight_cap=None)
        tr.optimizer = torch.optim.SGD(tr.model.parameters(), lr=0.0)  # the ratios are those of the start
        recomputes = []
        real = tr.compute_logprobs
        tr.compute_logprobs = lambda seqs, real=real, seen=recomputes: (seen.append(len(seqs)), real(seqs))[1]
        stats[decoupled] = tr.ppo_update(lower, adv)
        assert bool(recomputes) == decoupled and ("prox_t_start" in stats[decoupled]) == decoupled
    assert stats[False]["ratio_mean"] == pytest.approx(np.exp(0.5), rel=1e-3)
    assert stats[False]["behav_w_mean"] == pytest.approx(1.0)
    assert stats[True]["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert stats[True]["behav_w_mean"] == pytest.approx(np.exp(0.5), rel=1e-3)


def test_proximal_recompute_runs_without_dropout(tiny_model_dir):
    from areal_hpc.engines.torch_train import TorchTrainEngine

    tr = TorchTrainEngine(str(tiny_model_dir), lr=1e-3)
    for layer in tr.model.model.layers:  # a model trained with attention dropout
        layer.self_attn.attention_dropout = 0.5
    seqs = [np.array([1, 5, 7, 9, 11, 4, 6]), np.array([2, 8, 3])]
    first, second = tr.compute_logprobs(seqs), tr.compute_logprobs(seqs)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)  # deterministic: no dropout mask
    assert tr.model.training  # training mode is back for the PPO steps
    with torch.no_grad():  # and in training mode the same forward is noisy, so the test can tell
        noisy = [lp.numpy() for lp in tr._token_logprobs(seqs)]
    assert any(not np.allclose(a, b) for a, b in zip(first, noisy))


@pytest.mark.parametrize("kind", GEN_ENGINES)
def test_every_eos_in_generation_config_stops_a_sequence(tiny_model_dir, tmp_path, kind, make_gen):
    """A folder whose generation_config.json lists two EOS ids (as Qwen's does): either one ends an answer."""
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path / "two-eos"
    shutil.copytree(tiny_model_dir, folder)
    tok = load_tokenizer(folder)
    # two tokens the random model samples often, neither the tokenizer's EOS
    a, b = tok.convert_tokens_to_ids(["=", "<user>"])
    GenerationConfig(eos_token_id=[a, b], pad_token_id=tok.pad_token_id).save_pretrained(folder)
    stops = {a, b, tok.eos_token_id}
    eng = make_gen(kind, folder, seed=11)
    outs = generate(eng, _requests(tok, max_new=12, prompts=PROMPTS * 8))
    ended_on = set()
    for o in outs:
        assert not stops & set(o.output_ids[:-1]), o.output_ids  # nothing runs past a stop token
        if o.output_ids[-1] in stops:
            assert o.finish_reason == "stop"
            ended_on.add(o.output_ids[-1])
        else:
            assert (o.finish_reason, len(o.output_ids)) == ("length", 12)
    assert {a, b} <= ended_on, ended_on


def test_weight_bits_round_every_matrix_and_logprobs_are_those_of_the_rounded_weights(tiny_model_dir):
    """rollout.weight_bits: each row of each weight matrix takes at most 2^bits - 1 values, vectors stay exact,
    and the engine samples from (and records the logprobs of) the rounded weights, so the trainer sees a gap."""
    from areal_hpc.engines.torch_gen import fake_quantize

    exact = load_causal_lm(str(tiny_model_dir), "float32").state_dict()
    eng = TorchGenerationEngine(str(tiny_model_dir), weight_bits=3, seed=0)
    eng.update_weights({k: v.clone() for k, v in exact.items()}, version=1)
    held = eng.state_dict()
    for name, w in exact.items():
        if w.dim() == 2:
            assert max(len(torch.unique(row)) for row in held[name]) <= 7, name  # 3 bits: -3..3 times a scale
            assert not torch.equal(held[name], w), name
        else:
            assert torch.equal(held[name], w), name
    assert torch.equal(fake_quantize(exact, 3)["model.embed_tokens.weight"], held["model.embed_tokens.weight"])
    tok = load_tokenizer(str(tiny_model_dir))
    outs = generate(eng, _requests(tok, max_new=6))
    rounded = load_causal_lm(str(tiny_model_dir), "float32")
    rounded.load_state_dict(fake_quantize(exact, 3))
    full = load_causal_lm(str(tiny_model_dir), "float32")
    for o in outs:
        np.testing.assert_allclose(o.output_logprobs, _reference_logprobs(rounded, o), atol=1e-4)
    gap = max(np.abs(np.array(o.output_logprobs) - _reference_logprobs(full, o)).max() for o in outs)
    assert gap > 1e-3  # the trainer's exact weights give other logprobs: a mismatch on purpose
