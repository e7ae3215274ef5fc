"""The emulated engines and the simulator under the run's objective and LoRA: extra forwards, the adapter's sync."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from areal_hpc.config import load_config
from areal_hpc.costmodel import PRESETS, ResponseLengths
from areal_hpc.disk_estimate import read_model_shape
from areal_hpc.runtime.build import build_generation_engine, build_train_engine
from areal_hpc.simulate import sim_config, simulate

EMULATED = Path(__file__).resolve().parents[1] / "jobs" / "emulated_1p5b.yaml"
SHAPE = ["trainer.versions=3", "rollout.max_new_tokens=300"]
P, HEAD = 1.54e9, 1536 * 151936  # the 1.5B preset's parameters and its output layer's
NET, ADAPTER_R8 = 25e9, 2 * 8 * 28 * 41216  # bytes/s to a generator; a rank-8 adapter on every layer, bf16


def _run(*overrides: str):
    """A simulated run whose groups are all alike (300-token answers): a version's tokens never vary."""
    sim = sim_config(load_config(EMULATED, [*SHAPE, *overrides]), prompt_len=200)
    return simulate(replace(sim, lengths=ResponseLengths(300, 0.0, 300)))


def test_the_objectives_forwards_scale_a_versions_training_by_their_flops():
    base = _run().train_s_per_version
    # per token: 8 FLOPs a parameter (forward 2, backward 4, proximal forward 2), and 2 for each forward added
    assert _run("ppo.kl_coef=0.1").train_s_per_version / base == pytest.approx(10 / 8)  # the reference's
    assert _run("ppo.prox=loglinear").train_s_per_version / base == pytest.approx(6 / 8)  # no proximal forward
    gspo = _run("ppo.importance=sequence", "ppo.loss_agg=seq_mean_token_mean").train_s_per_version
    assert gspo / base == pytest.approx(1 + 2 * HEAD / (8 * P))  # the prepass: the output layer once more


def test_a_teachers_forward_costs_its_size_at_the_presets_scale(tiny_model_dir, tiny_qwen_dir):
    cfg = load_config(EMULATED, SHAPE)
    cfg.model.path, cfg.distill.teacher = str(tiny_model_dir), str(tiny_qwen_dir)  # real engines are not needed
    ratio = read_model_shape(tiny_qwen_dir).params / read_model_shape(tiny_model_dir).params
    plain = sim_config(load_config(EMULATED, SHAPE)).cost
    assert plain.train_tokens_per_s / sim_config(cfg).cost.train_tokens_per_s == pytest.approx(1 + 2 * ratio / 8)


def test_lora_syncs_the_adapters_bytes_in_the_simulator_and_the_emulated_engines(tiny_model_dir):
    full, lora = PRESETS["1.5B"].sync_s, 0.5 + ADAPTER_R8 / NET  # the load stays, the transfer shrinks
    assert full == pytest.approx(2 * P / NET + 0.5)
    cfg = load_config(EMULATED, [*SHAPE, "trainer.lora_rank=8"])
    assert sim_config(cfg).cost.sync_s == pytest.approx(lora)
    # synchronous (eta 0): each version's load is on the critical path, the first three of them
    saved = _run("rollout.eta=0").wall_s - _run("rollout.eta=0", "trainer.lora_rank=8").wall_s
    assert saved == pytest.approx(3 * (full - lora))
    # the emulated engines get the run's settings from its config: the generator's load, the trainer's rate
    assert build_generation_engine(cfg, tiny_model_dir, seed=0).cost.sync_s == pytest.approx(lora)
    kl = load_config(EMULATED, [*SHAPE, "ppo.kl_coef=0.1"])
    assert build_train_engine(kl, tiny_model_dir).cost.train_tokens_per_s == pytest.approx(
        PRESETS["1.5B"].train_tokens_per_s * 8 / 10
    )
