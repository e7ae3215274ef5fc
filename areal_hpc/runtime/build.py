"""Engines and the warm start built from a Config: shared by the synchronous loop and the MPI roles."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch.distributed as dist
from tqdm import tqdm

from areal_hpc.algo.ppo import Objective
from areal_hpc.config import Config
from areal_hpc.costmodel import settings_of
from areal_hpc.data import MathDataset, check_prompts_fit
from areal_hpc.engines import GenerationEngine, TrainEngine, make_generation_engine, make_train_engine
from areal_hpc.engines.lora import LoraSpec, adapter_params, model_skeleton, target_modules
from areal_hpc.model import DTYPES
from areal_hpc.model.teacher import check_teacher, distill_spec
from areal_hpc.model.weights import weights_checksum
from areal_hpc.rundir import RunDir
from areal_hpc.runtime.comm.weight_sync import cast_floating
from areal_hpc.utils import atomic_write_text, bar_interval
from areal_hpc.workflow.warm_start import warm_start_example, warm_start_targets


def _emulation_kwargs(cfg: Config) -> dict:
    emulation_cfg = cfg.emulation
    return dict(
        preset_name=emulation_cfg.preset,
        cost_overrides=dict(emulation_cfg.cost),
        time_scale=emulation_cfg.time_scale,
        payload_mb=emulation_cfg.payload_mb,
        run=settings_of(cfg),  # no teacher: distillation needs real engines
    )


def build_generation_engine(cfg: Config, model_dir: Path, seed: int) -> GenerationEngine:
    rollout_cfg = cfg.rollout
    if rollout_cfg.engine == "emulated":
        kw = _emulation_kwargs(cfg) | dict(model_path=str(model_dir), seed=seed, max_num_seqs=rollout_cfg.max_num_seqs)
        kw |= dict(len_median=cfg.emulation.len_median, len_sigma=cfg.emulation.len_sigma)
        return make_generation_engine("emulated", temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, **kw)
    extra = {}
    if rollout_cfg.engine == "vllm":
        extra = {"kv_cache_gib": rollout_cfg.kv_cache_gib, "tensor_parallel": cfg.cluster.devices_per_generator}
    if rollout_cfg.weight_bits:
        extra["weight_bits"] = rollout_cfg.weight_bits
    return make_generation_engine(
        rollout_cfg.engine,
        model_path=str(model_dir),
        temperature=rollout_cfg.temperature,
        top_p=rollout_cfg.top_p,
        dtype=cfg.model.dtype,
        seed=seed,
        device=cfg.cluster.device,
        max_num_seqs=rollout_cfg.max_num_seqs,
        **extra,
    )


def objective(cfg: Config) -> Objective:
    """The policy objective the ppo section names."""
    ppo_cfg = cfg.ppo
    return Objective(
        eps_clip=ppo_cfg.eps_clip,
        eps_clip_high=ppo_cfg.eps_clip_high,
        dual_clip=ppo_cfg.dual_clip,
        behav_cap=ppo_cfg.behav_imp_weight_cap or None,
        behav_weight=ppo_cfg.behav_weight,
        importance=ppo_cfg.importance,
        kl_coef=ppo_cfg.kl_coef,
        kl_estimator=ppo_cfg.kl_estimator,
        entropy_coef=ppo_cfg.entropy_coef,
        surrogate=ppo_cfg.objective,
        seq_reject_low=ppo_cfg.seq_reject_low,
        seq_reject_high=ppo_cfg.seq_reject_high,
    )


def lora_spec(cfg: Config) -> LoraSpec | None:
    """The adapter trainer.lora_* asks for; None trains every weight."""
    trainer_cfg = cfg.trainer
    if trainer_cfg.engine == "emulated":  # the payload stands for the adapter; its bytes are in the cost model's sync_s
        return None
    return (
        LoraSpec(trainer_cfg.lora_rank, trainer_cfg.lora_alpha, tuple(trainer_cfg.lora_targets))
        if trainer_cfg.lora_rank
        else None
    )


def check_model_fits(cfg: Config, model_dir: Path) -> MathDataset | None:
    """The start-up check the launchers run once, before any rank starts work: the prompts fit the model's
    context, trainer.lora_targets name layers the model has, and distill.teacher shares its tokenizer (one line
    each). Returns the dataset whose prompts it checked (None when it checked none)."""
    dataset = check_prompts_fit(cfg, model_dir)
    check_lora_targets(cfg, model_dir)
    check_teacher(cfg.distill.teacher, model_dir)
    return dataset


def check_lora_targets(cfg: Config, model_dir: Path) -> None:
    """trainer.lora_targets name linear layers the model has: one line if not."""
    if cfg.trainer.lora_rank:
        try:
            target_modules(model_skeleton(model_dir), cfg.trainer.lora_targets)
        except ValueError as err:
            raise ValueError(f"{err} (model {model_dir})") from None


def adapter_base(cfg: Config, run_dir: RunDir, model_dir: Path) -> Path:
    """The model a LoRA adapter trains on: the warm-started one when the run warm-starts, else model.path."""
    return run_dir.base_model if cfg.trainer.warm_start_steps else Path(model_dir)


def adapt_after_warm_start(cfg: Config, run_dir: RunDir, warm: TrainEngine, writer: bool) -> TrainEngine:
    """LoRA after a full-weight warm start: the warm-started model is written as the base folder (by one
    trainer, `writer`, atomically), and every trainer builds its adapter engine on it."""
    if writer:
        warm.export_hf(run_dir.base_model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # the folder is complete before anyone reads it
    del warm
    return build_train_engine(cfg, run_dir.base_model)


def write_lora_contract(cfg: Config, run_dir: RunDir, engine: TrainEngine, base_dir: Path, writer: bool) -> None:
    """What generators need to apply the adapters trainer 0 (`writer`) publishes (RunDir.lora_contract),
    atomically, before any weights are announced. The base checksum is of the weights as generators hold
    them. Every trainer calls it when gathering the weights is collective (ZeRO-3)."""
    if not (writer or engine.collective_weights):
        return
    spec = engine.lora
    base = engine.base_weights()
    if not writer:
        return
    crc = weights_checksum(cast_floating(base, DTYPES[cfg.model.dtype]))
    body = {
        "base_dir": str(Path(base_dir).resolve()),
        "base_checksum": crc,
        "rank": spec.rank,
        "alpha": spec.alpha,
        "layers": sorted(k.removesuffix(".lora_A.weight") for k in adapter_params(engine.model) if "lora_A" in k),
    }
    atomic_write_text(run_dir.lora_contract, json.dumps(body, indent=1))


def build_train_engine(cfg: Config, model_dir: Path, process_group=None, full: bool = False) -> TrainEngine:
    """The trainer of `cfg`; `full`: a plain torch trainer of every weight (LoRA's warm start, before the adapter)."""
    rc, pc, tc, dc = cfg.rollout, cfg.ppo, cfg.trainer, cfg.distill
    if tc.engine == "emulated":
        share = dict(share_prefixes=tc.share_prefixes, share_min_tokens=tc.share_min_tokens)
        kw = _emulation_kwargs(cfg) | share | dict(model_path=str(model_dir), max_tokens_per_mb=tc.max_tokens_per_mb)
        return make_train_engine("emulated", **kw)
    engine = "torch" if full else tc.engine
    extra = {"zero_stage": tc.zero_stage} if engine == "deepspeed" else {}
    return make_train_engine(
        engine,
        model_path=str(model_dir),
        lr=tc.lr,
        betas=tc.betas,
        weight_decay=tc.weight_decay,
        grad_clip=tc.grad_clip,
        max_tokens_per_mb=tc.max_tokens_per_mb,
        n_minibatches=pc.n_minibatches,
        objective=objective(cfg),
        loss_agg=pc.loss_agg,
        loss_norm_tokens=rc.max_new_tokens,
        prox=pc.prox,
        decoupled=pc.decoupled,
        temperature=rc.temperature,
        seed=tc.seed,
        process_group=process_group,
        device=cfg.cluster.device,
        bf16=tc.bf16,
        packing=tc.packing,
        share_prefixes=tc.share_prefixes,
        share_min_tokens=tc.share_min_tokens,
        logprob_chunk_tokens=tc.logprob_chunk_tokens,
        gradient_checkpointing=tc.gradient_checkpointing,
        lora=None if full else lora_spec(cfg),
        distill=None if full or not dc.teacher else distill_spec(dc.teacher, dc.coef, dc.estimator),
        **extra,
    )


def warm_start(trainer: TrainEngine, tokenizer, dataset: MathDataset, cfg: Config, progress: bool) -> float:
    """Supervised steps on each example's target (trainer.warm_start_template): the answer format, and near-miss
    mistakes for RL to start from.

    Every trainer rank runs the same steps on the same examples (same seed), so data-parallel
    trainers stay identical.
    """
    trainer_cfg = cfg.trainer
    examples = dataset.train[: trainer_cfg.warm_start_examples]
    targets = dict(zip((p.prompt_id for p in examples), warm_start_targets(examples, cfg)))
    rng = random.Random(cfg.trainer.seed)
    loss = float("nan")
    pace = bar_interval()  # in a file, a redraw every 20 s: each one stays in the log
    for _ in tqdm(
        range(trainer_cfg.warm_start_steps), desc="warm start", disable=not progress, leave=False, mininterval=pace
    ):
        batch = rng.sample(examples, min(trainer_cfg.warm_start_batch, len(examples)))
        seqs, masks = [], []
        for p in batch:
            seq, mask = warm_start_example(p, targets[p.prompt_id], cfg, rng, tokenizer)
            seqs.append(np.asarray(seq))
            masks.append(np.asarray(mask))
        loss = trainer.supervised_step(seqs, masks, trainer_cfg.warm_start_lr)
    return loss
