"""LoRA: the trainer's adapter (PEFT) against Hugging Face PEFT, merged into both generation engines, checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from areal_hpc.engines import lora as lora_lib
from areal_hpc.engines.base import generate
from areal_hpc.engines.lora import AdapterMerger, LoraSpec
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.model import load_causal_lm, load_tokenizer
from areal_hpc.types import GenRequest

PROMPTS = ["07+35=", "1+2=", "13+9=", "50+5="]


def _requests(tok, greedy):
    return [GenRequest(f"{i}:0", tok.encode(p), 8, greedy=greedy) for i, p in enumerate(PROMPTS)]


def _hf_logprobs(model, o):
    seq = torch.tensor([o.prompt_ids + o.output_ids])
    with torch.no_grad():
        logits = model(seq).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None]).squeeze(-1)[len(o.prompt_ids) - 1 :].numpy()


def _random_adapter(engine: TorchTrainEngine, seed=0, scale=0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_lib.adapter_params(engine.model).values():
            p.copy_(scale * torch.randn(p.shape, generator=g))


def _peft_model(base_dir, spec: LoraSpec, adapter: dict):
    """Hugging Face PEFT's own model with the same adapter: the reference the merged engines must equal."""
    from peft import LoraConfig, get_peft_model

    targets = list(spec.targets) or "all-linear"
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(load_causal_lm(base_dir), config).eval()
    state = {f"base_model.model.{k.replace('.weight', '.default.weight')}": v for k, v in adapter.items()}
    missing = model.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys and all(".lora_" not in k for k in missing.missing_keys)
    return model


@pytest.fixture
def make_gen():
    made = []

    def make(kind, path):
        if kind == "torch":
            from areal_hpc.engines.torch_gen import TorchGenerationEngine

            eng = TorchGenerationEngine(str(path))
        else:
            from areal_hpc.engines.vllm_gen import VLLMGenerationEngine

            eng = VLLMGenerationEngine(str(path))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


@pytest.mark.parametrize(
    "kind,targets",
    [("torch", ()), ("vllm", ()), ("vllm", ("q_proj", "v_proj"))],  # q and v only: vLLM fuses them with k
)
def test_adapter_merged_on_the_generator_equals_peft_and_the_merged_model(
    kind, targets, tiny_model_dir, tmp_path, make_gen
):
    tok = load_tokenizer(tiny_model_dir)
    eng = make_gen(kind, tiny_model_dir)
    base = generate(eng, _requests(tok, greedy=True))
    spec = LoraSpec(4, 8.0, targets)
    tr = TorchTrainEngine(str(tiny_model_dir), lora=spec)
    layers = sorted({k.rsplit(".lora_", 1)[0] for k in tr.weights()})
    merger = AdapterMerger(load_causal_lm(tiny_model_dir).state_dict(), layers, spec.scale)  # the base folder's

    # a zero adapter (B = 0, PEFT's start) is exactly the base model
    eng.update_weights(merger.merged(tr.weights()), version=1)
    zero = generate(eng, _requests(tok, greedy=True))
    assert [o.output_ids for o in zero] == [o.output_ids for o in base]
    for a, b in zip(zero, base):
        np.testing.assert_array_equal(a.output_logprobs, b.output_logprobs)

    # a random adapter: the engine decodes merged weights, and its tokens and logprobs are PEFT's own
    _random_adapter(tr)
    adapter = {k: v.clone() for k, v in tr.weights().items()}
    eng.update_weights(merger.merged(adapter), version=2)
    greedy = generate(eng, _requests(tok, greedy=True))
    assert [o.output_ids for o in greedy] != [o.output_ids for o in base]
    assert all(v == 2 for o in greedy for v in o.output_versions)
    peft = _peft_model(tiny_model_dir, spec, adapter)
    merged = load_causal_lm(tr.export_hf(tmp_path / "merged")).eval()
    sampled = generate(eng, _requests(tok, greedy=False))
    trainer_lp = tr.compute_logprobs([np.array(o.prompt_ids + o.output_ids) for o in greedy + sampled])
    for o, lp in zip(greedy + sampled, trainer_lp):
        np.testing.assert_allclose(o.output_logprobs, _hf_logprobs(peft, o), atol=1e-4)
        np.testing.assert_allclose(o.output_logprobs, _hf_logprobs(merged, o), atol=1e-4)
        np.testing.assert_allclose(o.output_logprobs, lp[len(o.prompt_ids) :], atol=1e-4)
    with torch.no_grad():  # greedy tokens: PEFT's generate picks the same ones
        for p, o in zip(PROMPTS, greedy):
            ids = torch.tensor([tok.encode(p)])
            ref = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
            out = ref[0, ids.shape[1] :].tolist()
            assert out[: len(o.output_ids)] == o.output_ids
    # a second version replaces the first: merging starts from the base each time, not from what was loaded
    eng.update_weights(merger.merged({k: torch.zeros_like(v) for k, v in adapter.items()}), version=3)
    again = generate(eng, _requests(tok, greedy=True))
    for a, b in zip(again, base):
        np.testing.assert_array_equal(a.output_logprobs, b.output_logprobs)


def test_lora_trainer_trains_the_adapter_alone_references_the_base_and_resumes_exactly(
    tiny_model_dir, ppo_batch, tmp_path
):
    from areal_hpc.algo.ppo import Objective

    trajs, adv = ppo_batch
    spec = LoraSpec(8, 16.0, ("q_proj", "v_proj", "down_proj"))

    def engine():
        return TorchTrainEngine(str(tiny_model_dir), lr=1e-2, seed=0, lora=spec, objective=Objective(kl_coef=0.1))

    a = engine()
    trained = {id(p) for g in a.optimizer.param_groups for p in g["params"]}
    assert trained == {id(p) for p in lora_lib.adapter_params(a.model).values()}
    assert len(trained) == 2 * 2 * 3  # A and B on 3 layer kinds in each of 2 layers
    base0 = {k: v.clone() for k, v in a.base_weights().items()}
    seqs = [t.input_ids for t in trajs]
    lp0 = a.compute_logprobs(seqs)
    stats = a.ppo_update(trajs, adv)
    assert stats["kl"] > 0  # the term is on: the minibatch steps move the adapter away from the base
    # the frozen base did not move, the policy did; the KL reference is the base (the adapter switched off)
    for k, v in a.base_weights().items():
        assert torch.equal(v, base0[k]), k
    assert max(np.abs(x - y).max() for x, y in zip(lp0, a.compute_logprobs(seqs))) > 1e-3
    assert a.reference is None  # no second model
    for x, y in zip(lp0, a._reference_logprobs(seqs)):
        np.testing.assert_allclose(y.numpy(), x, atol=1e-6)

    a.save_checkpoint(tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["adapter.safetensors", "meta.json", "trainer_state.pt"]
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["lora"]["rank"] == 8
    a.ppo_update(trajs, adv)
    b = engine()
    b.load_checkpoint(tmp_path / "ckpt")
    b.ppo_update(trajs, adv)  # the same next step as never stopping: weights, logprobs, Adam's moments
    for k, v in a.weights().items():
        torch.testing.assert_close(b.weights()[k], v, rtol=0, atol=0)
    for x, y in zip(a.compute_logprobs(seqs), b.compute_logprobs(seqs)):
        np.testing.assert_array_equal(x, y)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for i in sa:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sb[i][key], sa[i][key], rtol=0, atol=0)
    # a checkpoint of full weights, or of another adapter, is refused in one line
    with pytest.raises(ValueError, match="rank-8 adapter"):
        TorchTrainEngine(str(tiny_model_dir), lora=LoraSpec(4, 16.0)).load_checkpoint(tmp_path / "ckpt")


def test_a_generator_refuses_other_base_weights_than_the_trainers_in_one_line(tiny_model_dir, tmp_path):
    from areal_hpc.engines.torch_gen import TorchGenerationEngine
    from areal_hpc.model.weights import weights_checksum
    from areal_hpc.rundir import RunDir
    from areal_hpc.runtime.generation.adapters import AdapterLoader, BaseMismatch

    spec = LoraSpec(4, 8.0)
    tr = TorchTrainEngine(str(tiny_model_dir), lora=spec)
    run = RunDir(tmp_path)
    contract = {
        "base_dir": str(tiny_model_dir),
        "base_checksum": weights_checksum(tr.base_weights()),
        "rank": 4,
        "alpha": 8.0,
        "layers": sorted({k.rsplit(".lora_", 1)[0] for k in tr.weights()}),
    }
    run.weights.mkdir()
    run.lora_contract.write_text(json.dumps(contract))
    gen = TorchGenerationEngine(str(tiny_model_dir))
    loader = AdapterLoader(spec, run, tiny_model_dir, "float32")
    assert {k: tuple(v.shape) for k, v in loader.template().items()} == {
        k: tuple(v.shape) for k, v in tr.weights().items()
    }
    _random_adapter(tr)
    gen.update_weights(loader.merged(gen, tr.weights()), version=1)  # the trainers' base: merged and loaded
    for k, v in lora_lib.merged_state(tr.model, spec.scale).items():
        torch.testing.assert_close(gen.state_dict()[k], v, rtol=0, atol=1e-6)
    other = TorchGenerationEngine(str(tiny_model_dir))
    with torch.no_grad():
        next(iter(other.model.parameters())).add_(1e-3)  # a generator that loaded something else
    with pytest.raises(BaseMismatch) as err:
        AdapterLoader(spec, run, tiny_model_dir, "float32").merged(other, tr.weights())
    assert "\n" not in str(err.value) and "base weights" in str(err.value)
