"""Engines and the warm start built from a Config: shared by the synchronous loop and the MPI roles."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from tqdm import tqdm

from areal_hpc.algo.ppo import Objective
from areal_hpc.config import Config
from areal_hpc.data import MathDataset, arithmetic_completion
from areal_hpc.engines import GenerationEngine, TrainEngine, make_generation_engine, make_train_engine


def _emulation_kwargs(cfg: Config) -> dict:
    ec = cfg.emulation
    return dict(
        preset_name=ec.preset,
        cost_overrides=dict(ec.cost),
        time_scale=ec.time_scale,
        payload_mb=ec.payload_mb,
    )


def build_generation_engine(cfg: Config, model_dir: Path, seed: int) -> GenerationEngine:
    rc = cfg.rollout
    if rc.engine == "emulated":
        kw = _emulation_kwargs(cfg) | dict(model_path=str(model_dir), seed=seed, max_num_seqs=rc.max_num_seqs)
        kw |= dict(len_median=cfg.emulation.len_median, len_sigma=cfg.emulation.len_sigma)
        return make_generation_engine("emulated", temperature=rc.temperature, top_p=rc.top_p, **kw)
    extra = {"kv_cache_gib": rc.kv_cache_gib} if rc.engine == "vllm" else {}
    return make_generation_engine(
        rc.engine,
        model_path=str(model_dir),
        temperature=rc.temperature,
        top_p=rc.top_p,
        dtype=cfg.model.dtype,
        seed=seed,
        device=cfg.cluster.device,
        max_num_seqs=rc.max_num_seqs,
        **extra,
    )


def objective(cfg: Config) -> Objective:
    """The policy objective the ppo section names."""
    pc = cfg.ppo
    return Objective(
        eps_clip=pc.eps_clip,
        eps_clip_high=pc.eps_clip_high,
        dual_clip=pc.dual_clip,
        behav_cap=pc.behav_imp_weight_cap or None,
        behav_weight=pc.behav_weight,
        importance=pc.importance,
        kl_coef=pc.kl_coef,
        kl_estimator=pc.kl_estimator,
        entropy_coef=pc.entropy_coef,
    )


def build_train_engine(cfg: Config, model_dir: Path, process_group=None) -> TrainEngine:
    rc, pc, tc = cfg.rollout, cfg.ppo, cfg.trainer
    if tc.engine == "emulated":
        return make_train_engine("emulated", **(_emulation_kwargs(cfg) | dict(model_path=str(model_dir))))
    extra = {"zero_stage": tc.zero_stage} if tc.engine == "deepspeed" else {}
    return make_train_engine(
        tc.engine,
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
        logprob_chunk_tokens=tc.logprob_chunk_tokens,
        gradient_checkpointing=tc.gradient_checkpointing,
        **extra,
    )


def warm_start_segments(p, cfg: Config, rng: random.Random) -> list[tuple[str, bool]]:
    """The reference episode of one problem, as (text, trained) segments: its answer, or for the arithmetic
    task under the `tool` workflow (a share workflow.warm_start_tool_share of them) a tool call whose output
    is not trained, then the answer."""
    if cfg.data.kind != "arithmetic":
        return [(p.answer, True)]
    answer = arithmetic_completion(p.answer)
    wc = cfg.workflow
    if cfg.rollout.workflow != "tool" or rng.random() >= wc.warm_start_tool_share:
        return [(answer, True)]
    from areal_hpc.workflow.builtin import tool_observation

    code = f"```python\nprint({p.row['question'].rstrip('=')})\n```\n"
    return [(code, True), (tool_observation(p.answer), False), (answer, True)]


def warm_start(trainer: TrainEngine, tokenizer, dataset: MathDataset, cfg: Config, progress: bool) -> float:
    """Supervised steps on reference answers: RL needs near-miss mistakes to start from.

    Every trainer rank runs the same steps on the same examples (same seed), so data-parallel
    trainers stay identical.
    """
    tc = cfg.trainer
    examples = dataset.train[: tc.warm_start_examples]
    rng = random.Random(cfg.trainer.seed)
    eos = tokenizer.eos_token_id
    loss = float("nan")
    for _ in tqdm(range(tc.warm_start_steps), desc="warm start", disable=not progress, leave=False):
        batch = rng.sample(examples, min(tc.warm_start_batch, len(examples)))
        seqs, masks = [], []
        for p in batch:
            seq, mask = list(p.prompt_ids), [0] * len(p.prompt_ids)  # built as every rollout's prompt is
            for text, trained in warm_start_segments(p, cfg, rng):
                ids = tokenizer.encode(text, add_special_tokens=False)
                seq += ids
                mask += [int(trained)] * len(ids)
            seqs.append(np.asarray(seq + [eos]))
            masks.append(np.asarray(mask + [1]))
        loss = trainer.supervised_step(seqs, masks, tc.warm_start_lr)
    return loss
