"""Disk a run will fill: the checkpoints kept, the shard store's growth, the published weight folders (pure)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.store.shard_schema import EPISODE_FIELDS, OFFSETS_DTYPE, TOKEN_FIELDS, TRAJ_FIELDS

# Bytes a shard stores per token (input_ids, behav_logprobs, versions, loss_mask: 13) and per trajectory (its
# per-trajectory columns and its offset: 88, and its episode's row when it is the episode's only transcript: 40),
# uncompressed (store.compression=none)
TOKEN_BYTES = sum(dt.itemsize for dt in TOKEN_FIELDS.values())
TRAJ_BYTES = sum(dt.itemsize for dt in (TRAJ_FIELDS | EPISODE_FIELDS).values()) + OFFSETS_DTYPE.itemsize
# store.compression's size reduction of the token columns: the worst case docs/run-dir.md measured (token ids
# uniform over a 151k vocabulary; text's Zipf-like ids gave 2.27 and 2.57), so the estimate stays an upper bound
COMPRESSION_RATIOS = {"none": 1.0, "lzf": 2.15, "gzip": 2.39}
ADAM_BYTES = 8  # exp_avg and exp_avg_sq, fp32, one each per parameter
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its parameters and how many of them a tied output head shares."""

    params: int
    tied: int = 0  # parameters of the input embedding that the output head reuses (0: untied)
    adapter_per_rank: int = 0  # LoRA on every linear layer but the head: parameters per unit of rank (0: unknown)

    def adapter(self, rank: int) -> int:
        """A rank-`rank` adapter's parameters (an upper bound when trainer.lora_targets picks fewer layers)."""
        return rank * self.adapter_per_rank


def model_shape(config: dict) -> ModelShape:
    """Parameters of a Llama/Qwen2-style decoder from its config.json: embedding, per layer attention (q, k,
    v with grouped KV heads; biases when the architecture has them) and the gated MLP, norms, the head.
    Other shapes (mixtures of experts, ...) count wrong or lack a key (ValueError): give a parameter count."""
    missing = [k for k in _SHAPE_KEYS if k not in config]
    if missing:
        raise ValueError(f"config.json has no {missing[0]!r}: pass estimate_disk the parameter count")
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    vocab = config["vocab_size"]
    bias = config.get("attention_bias", config.get("model_type") == "qwen2")  # Qwen2 has q/k/v biases
    attn = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
    if bias:
        attn += heads * head_dim + 2 * kv * head_dim
    per_layer = attn + 3 * h * inter + 2 * h  # + input and post-attention RMSNorm
    embed = vocab * h
    tied = bool(config.get("tie_word_embeddings", False))
    q, k = heads * head_dim, kv * head_dim  # LoRA: r x (in + out) for q, k, v, o, gate, up, down
    per_rank = layers * ((h + q) * 2 + (h + k) * 2 + (h + inter) * 3)
    return ModelShape(embed + layers * per_layer + h + (0 if tied else embed), embed if tied else 0, per_rank)


def read_model_shape(model_dir: str | Path) -> ModelShape | None:
    """model_shape of a model folder's config.json; None when the folder has none (not built or copied yet)."""
    path = Path(model_dir) / "config.json"
    return model_shape(json.loads(path.read_text())) if path.is_file() else None


def checkpoint_bytes(cfg, shape: ModelShape) -> int:
    """One trainer checkpoint, all ranks' files together (ZeRO partitions the same bytes across ranks).

    torch engine: the fp32 master weights (model.safetensors, a tied head's tensor written twice) and
    AdamW's two fp32 moments. DeepSpeed ZeRO keeps a flat fp32 copy of the weights in its optimizer state
    besides the moments, and saves the module too, in its compute dtype (bf16 with trainer.bf16); under
    ZeRO-3 the module's parameters are partitioned and the module file holds none. With ppo.kl_coef the
    reference policy is saved beside them (reference.safetensors, in the trainer's compute dtype). With LoRA
    the same holds for the adapter alone (the base is the model folder, or RUN_DIR/base_model once), plus
    adapter.safetensors (fp32), and there is no reference file."""
    trainer_cfg = cfg.trainer
    if trainer_cfg.engine == "emulated":
        return 0
    if trainer_cfg.lora_rank:
        n = shape.adapter(trainer_cfg.lora_rank)
        if trainer_cfg.engine == "deepspeed":
            return n * ((2 if trainer_cfg.bf16 else 4) + 4 + ADAM_BYTES) + n * 4
        return n * (4 + ADAM_BYTES)
    reference = (shape.params + shape.tied) * (2 if trainer_cfg.bf16 else 4) if cfg.ppo.kl_coef else 0
    if trainer_cfg.engine == "deepspeed":
        module = 0 if trainer_cfg.zero_stage == 3 else (2 if trainer_cfg.bf16 else 4)
        return shape.params * (module + 4 + ADAM_BYTES) + reference
    return (shape.params + shape.tied) * 4 + shape.params * ADAM_BYTES + reference


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale or unit == "MB":
            return f"{n / scale:.3g} {unit}"


@dataclass(frozen=True)
class DiskEstimate:
    """The parts of a run's disk use; `describe()` puts them in one line."""

    params: int
    checkpoint_bytes: int  # one checkpoint
    checkpoints_kept: int  # trainer.keep_checkpoints, or every checkpoint the run writes when that is 0
    checkpoints_peak: int  # kept + 1 when pruning: a new checkpoint is complete before the oldest goes
    rollout_bytes_per_version: int  # shards of one version's groups, all answers max_new_tokens long
    versions: int
    weights_bytes: int  # one published weights folder (sync.method=disk), else 0
    weights_kept: int  # sync.keep_versions with sync.method=disk, else 0 (one more between publish and prune)
    upper_bound: bool  # every answer assumed max_new_tokens long (no mean length was given)
    compression: str = "none"  # store.compression, counted in rollout_bytes_per_version

    @property
    def checkpoints_total(self) -> int:
        return self.checkpoint_bytes * self.checkpoints_kept

    @property
    def rollouts_total(self) -> int:
        return self.rollout_bytes_per_version * self.versions

    @property
    def weights_total(self) -> int:
        return self.weights_bytes * self.weights_kept

    @property
    def total(self) -> int:
        """At the run's end, with the moment a new checkpoint and weights folder exist beside the kept ones."""
        peak_weights = self.weights_bytes * (self.weights_kept + 1) if self.weights_kept else 0
        return self.checkpoint_bytes * self.checkpoints_peak + self.rollouts_total + peak_weights

    def describe(self) -> str:
        about = "<=" if self.upper_bound else "~"
        ck, n = self.checkpoint_bytes, self.checkpoints_kept
        parts = [f"checkpoints {n} x {_size(ck)} = {_size(ck * n)}"]
        if self.checkpoints_peak > n:
            parts[0] += f" (+{_size(ck)} while the next is written)"
        per100 = self.rollout_bytes_per_version * 100
        packed = f", {self.compression}" if self.compression != "none" else ""
        parts.append(
            f"rollouts {about}{_size(per100)} per 100 versions ({_size(self.rollouts_total)} for {self.versions}"
            f"{packed})"
        )
        if self.weights_kept:
            parts.append(f"weights {self.weights_kept} x {_size(self.weights_bytes)} = {_size(self.weights_total)}")
        return f"disk: {', '.join(parts)}, total {about}{_size(self.total)}"


def estimate_disk(
    cfg,
    shape: ModelShape | int | None = None,
    prompt_tokens: float | None = None,
    new_tokens: float | None = None,
    groups_per_version: float | None = None,
    compression_ratio: float | None = None,
) -> DiskEstimate:
    """What a run of `cfg` (a loaded Config) will write.

    shape: the model's ModelShape or parameter count; None reads cfg.model.path's config.json.
    prompt_tokens: mean prompt length (default data.max_prompt_tokens, else 512).
    new_tokens: mean answer length (default rollout.max_new_tokens: an upper bound, said with "<=").
    groups_per_version: groups stored per version (default rollout.batch_prompts; the store also keeps the
    groups rank 0 rejects as uniform and drops as stale, so B / (1 - rejected share) is closer when many are).
    compression_ratio: the store's size reduction of the token columns (default: store.compression's in
    COMPRESSION_RATIOS, the worst case benchmarks/store_io.py --compression measured; 1: none).
    """
    if shape is None:
        shape = read_model_shape(cfg.model.path)
        if shape is None:
            raise ValueError(f"no config.json in model.path={cfg.model.path!r}; pass the parameter count")
    if isinstance(shape, int):
        shape = ModelShape(shape)
    tc, rc, sc = cfg.trainer, cfg.rollout, cfg.sync
    every = tc.checkpoint_every
    written = 1 + (tc.versions // every + bool(tc.versions % every) if every else 1)  # the start, ..., the end
    kept = min(tc.keep_checkpoints, written) if tc.keep_checkpoints else written
    prompt = prompt_tokens if prompt_tokens is not None else (cfg.data.max_prompt_tokens or 512)
    answer = new_tokens if new_tokens is not None else rc.max_new_tokens
    groups = groups_per_version if groups_per_version is not None else rc.batch_prompts
    if compression_ratio is None:
        compression_ratio = COMPRESSION_RATIOS[cfg.store.compression]
    per_traj = (prompt + answer) * TOKEN_BYTES / compression_ratio + TRAJ_BYTES
    disk = sc.method == "disk"
    sent = shape.adapter(tc.lora_rank) if tc.lora_rank else shape.params  # a tied head is written once
    weights = sent * DTYPE_BYTES[cfg.model.dtype] if disk else 0
    return DiskEstimate(
        params=shape.params,
        checkpoint_bytes=checkpoint_bytes(cfg, shape),
        checkpoints_kept=kept,
        checkpoints_peak=kept + (kept < written),
        rollout_bytes_per_version=math.ceil(groups * rc.n_samples * per_traj),
        versions=tc.versions,
        weights_bytes=weights,
        weights_kept=sc.keep_versions if disk else 0,
        upper_bound=new_tokens is None,
        compression=cfg.store.compression,
    )
