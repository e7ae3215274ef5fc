"""What generation, training and weight sync cost on a GPU cluster: a cost model with presets (pure, no I/O).

The emulated engines sleep for these times instead of computing, and the simulator advances its clock
by them. Each preset is derived from the model's shape and the GPU's datasheet figures, with the
efficiencies stated; docs/emulation.md writes the arithmetic out and checks it against AReaL's figures.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Per-GPU costs (a generator over several GPUs: tensor_parallel). A decode step takes the longer of reading
    the weights and every running sequence's KV cache (memory) and its matrix products (compute); on GPUs memory
    wins, on CPUs compute does. Prefill and training are compute-bound."""

    name: str
    weight_bytes: float  # bf16 weights, read once per decode step
    kv_bytes_per_token: float  # K and V of every layer for one token of context
    mem_bytes_per_s: float  # achieved HBM bandwidth in decode
    step_overhead_s: float  # per decode step: scheduling, sampling, launches
    seq_step_s: float  # compute of one running sequence's token in a decode step
    prefill_tokens_per_s: float  # compute-bound prompt (and resumed partial) processing
    train_tokens_per_s: float  # PPO: forward + backward + the proximal logprob pass, per trainer GPU
    sync_s: float  # one version's weights over the network and loaded into a generator
    net_bytes_per_s: float = math.inf  # of sync_s, the transfer's rate (inf: unknown, sync_s is all load)

    def decode_step_s(self, batch: int, context_tokens):
        """One step of `batch` (>= 1) running sequences holding `context_tokens` of KV cache in all
        (a number, or an array of them for consecutive steps)."""
        read = self.weight_bytes + self.kv_bytes_per_token * np.asarray(context_tokens, dtype=np.float64)
        return self.step_overhead_s + np.maximum(read / self.mem_bytes_per_s, self.seq_step_s * batch)

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def train_s(self, tokens: int) -> float:
        """PPO on `tokens` token positions computed (with prefix sharing, fewer than the tokens trained on:
        `train_tokens`)."""
        return tokens / self.train_tokens_per_s

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float  # dense
    net_bytes_per_s: float  # to each generator, for the weight broadcast


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16

    @property
    def head_params(self) -> int:
        """The output layer's parameters (hidden x vocabulary)."""
        return self.hidden * self.vocab

    def adapter_per_rank(self, targets: Sequence[str] = ()) -> int:
        """A LoRA adapter's parameters per unit of rank, r x (in + out) on each targeted linear layer of each
        decoder layer (() = all; never the output layer, engines/lora.py)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        sizes = {"q_proj": 2 * h, "k_proj": h + kv, "v_proj": h + kv, "o_proj": 2 * h}
        sizes |= dict.fromkeys(("gate_proj", "up_proj", "down_proj"), h + self.intermediate)
        unknown = sorted(set(targets) - set(sizes))
        if unknown:
            raise ValueError(f"trainer.lora_targets {unknown[0]!r} is no linear layer of {self.name}: {sorted(sizes)}")
        return self.layers * sum(n for name, n in sizes.items() if not targets or name in targets)


# Datasheet figures. H800 SXM: HBM3 3.35 TB/s and 989 TFLOPS dense bf16 as H100 SXM; its interconnect is cut,
# so 200 Gb/s InfiniBand (25 GB/s) per generator is assumed for the weight broadcast.
H800 = Gpu("H800", hbm_bytes_per_s=3.35e12, bf16_flops=989e12, net_bytes_per_s=25e9)
# DeepSeek-R1-Distill-Qwen (AReaL's base models): Qwen2.5 shapes with grouped-query attention
QWEN_1P5B = ModelShape(
    "1.5B", 1.54e9, layers=28, kv_heads=2, head_dim=128, hidden=1536, intermediate=8960, vocab=151936
)
QWEN_7B = ModelShape("7B", 7.62e9, layers=28, kv_heads=4, head_dim=128, hidden=3584, intermediate=18944, vocab=152064)

# Efficiencies assumed (vLLM and Megatron/DeepSpeed class software on Hopper)
DECODE_MEM_EFF = 0.70  # of HBM bandwidth reached by paged attention + GEMV-shaped decode
DECODE_OVERHEAD_S = 3e-3  # per step with CUDA graphs: scheduler, sampler, detokenizer
PREFILL_MFU = 0.50
TRAIN_MFU = 0.35  # long packed sequences, ZeRO with activation checkpointing
TRAIN_FLOPS_PER_PARAM = 8  # forward 2 + backward 4 + the proximal-logprob forward 2
LOAD_S = 0.5  # a generator swapping in received weights and resetting its prefix cache
# A generator over N devices (tensor parallel, cluster.devices_per_generator) splits its weights, KV cache and
# matrix products N ways, each device at this efficiency; its per-step overhead stays whole. Assumed, not
# measured (no GPU has run this path here): Megatron-LM's split adds two all-reduces per layer to each step; at
# 10-20 us each on NVLink (NCCL's small-message latency), the 7B preset's 56 add 0.6-1.1 ms to the 3.3 ms a
# TP 2 step spends reading its half of the weights, 0.75-0.85 of perfect scaling. Smaller models fare worse.
# benchmarks/gpu_check.sh's TP 1 against TP 2 tokens/s is the figure to replace it with.
TP_EFFICIENCY = 0.8


def tensor_parallel(cost: CostModel, devices: int) -> CostModel:
    """`cost` (one device's) for a generator over `devices` devices: decode's reads and products and the prefill
    run on all of them at TP_EFFICIENCY each. A weight sync is unchanged: the version's bytes still reach the
    generator's node once and each device loads its share."""
    if devices == 1:
        return cost
    speedup = devices * TP_EFFICIENCY
    return replace(
        cost,
        name=f"{cost.name}-tp{devices}",
        mem_bytes_per_s=cost.mem_bytes_per_s * speedup,
        seq_step_s=cost.seq_step_s / speedup,
        prefill_tokens_per_s=cost.prefill_tokens_per_s * speedup,
    )


def derive(model: ModelShape, gpu: Gpu) -> CostModel:
    """The cost model of `model` on `gpu` from their figures and the efficiencies above."""
    weight_bytes = 2 * model.params
    return CostModel(
        name=f"{model.name}-{gpu.name}",
        weight_bytes=weight_bytes,
        kv_bytes_per_token=model.kv_bytes_per_token,
        mem_bytes_per_s=DECODE_MEM_EFF * gpu.hbm_bytes_per_s,
        step_overhead_s=DECODE_OVERHEAD_S,
        seq_step_s=2 * model.params / (PREFILL_MFU * gpu.bf16_flops),
        prefill_tokens_per_s=PREFILL_MFU * gpu.bf16_flops / (2 * model.params),
        train_tokens_per_s=TRAIN_MFU * gpu.bf16_flops / (TRAIN_FLOPS_PER_PARAM * model.params),
        sync_s=weight_bytes / gpu.net_bytes_per_s + LOAD_S,
        net_bytes_per_s=gpu.net_bytes_per_s,
    )


SHAPES: dict[str, ModelShape] = {m.name: m for m in (QWEN_1P5B, QWEN_7B)}
PRESETS: dict[str, CostModel] = {name: derive(m, H800) for name, m in SHAPES.items()}  # on an H800


def preset(name: str) -> CostModel:
    if name not in PRESETS:
        raise ValueError(f"cost model preset {name!r} is unknown; choose " + " or ".join(map(repr, PRESETS)))
    return PRESETS[name]


def with_overrides(model: CostModel, overrides: dict[str, float]) -> CostModel:
    """The model with some fields replaced (a calibration's fit, or a user's figures)."""
    fields = set(CostModel.__dataclass_fields__) - {"name"}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"cost model has no field {bad[0]!r}; fields: {', '.join(sorted(fields))}")
    return replace(model, **{k: float(v) for k, v in overrides.items()})


@dataclass(frozen=True)
class RunSettings:
    """What a run's settings change in a preset's costs, which are decoupled PPO with the proximal recompute,
    publishing every weight. Each forward over the tokens trained costs 2 FLOPs per parameter it passes."""

    prox_forward: bool = True  # ppo.prox=recompute with ppo.decoupled (in the presets' 8 FLOPs)
    ref_forward: bool = False  # ppo.kl_coef != 0: the reference policy's forward
    teacher_params: float = 0.0  # distill.teacher: its forward, of its parameters (0: no teacher)
    head_prepass: bool = False  # ppo.importance=sequence: GSPO's second pass of the output layer
    lora_rank: int = 0  # trainer.lora_rank: the adapter alone is published
    lora_targets: tuple[str, ...] = ()
    gen_devices: int = 1  # cluster.devices_per_generator: each generator's engine over this many (tensor_parallel)

    def train_flops_per_token(self, shape: ModelShape) -> float:
        """Forward and backward (2 + 4) and the forwards the settings add, per token trained."""
        policy = 2 * shape.params * (3 + self.prox_forward + self.ref_forward)
        return policy + 2 * self.teacher_params + 2 * shape.head_params * self.head_prepass

    def sync_bytes(self, shape: ModelShape) -> float:
        """Bytes a version sends (bf16): the adapter's with LoRA, else every weight."""
        return 2 * (self.lora_rank * shape.adapter_per_rank(self.lora_targets) if self.lora_rank else shape.params)


def settings_of(cfg, teacher_params: float = 0.0) -> RunSettings:
    """The RunSettings of a run config (a teacher's parameters are the caller's to count: its folder is I/O)."""
    pc, tc = cfg.ppo, cfg.trainer
    return RunSettings(
        prox_forward=pc.decoupled and pc.prox == "recompute",
        ref_forward=bool(pc.kl_coef),
        teacher_params=teacher_params if cfg.distill.teacher else 0.0,
        head_prepass=pc.importance == "sequence",
        lora_rank=tc.lora_rank,
        lora_targets=tuple(tc.lora_targets),
        gen_devices=cfg.cluster.devices_per_generator,
    )


def for_run(cost: CostModel, shape: ModelShape, run: RunSettings) -> CostModel:
    """`cost` (the preset's shape) under a run's settings: a PPO version's time scales with its FLOPs, with
    LoRA a sync moves the adapter's bytes instead of the weights' (the load into the generator stays), and a
    generator over several devices steps faster (tensor_parallel)."""
    factor = run.train_flops_per_token(shape) / (TRAIN_FLOPS_PER_PARAM * shape.params)
    sync_s = cost.sync_s
    if run.lora_rank:
        load_s = max(0.0, cost.sync_s - cost.weight_bytes / cost.net_bytes_per_s)
        sync_s = load_s + run.sync_bytes(shape) / cost.net_bytes_per_s
    cost = tensor_parallel(cost, run.gen_devices)
    return replace(cost, train_tokens_per_s=cost.train_tokens_per_s / factor, sync_s=sync_s)


def emulated_cost(preset_name: str, overrides: dict | None = None, run: RunSettings | None = None) -> CostModel:
    """The preset with a user's fields replaced, under the run's settings (none: as the preset assumes)."""
    cost = with_overrides(preset(preset_name), overrides or {})
    return for_run(cost, SHAPES[preset_name], run) if run is not None else cost


def train_tokens(
    prefix: int, continuations: Sequence[int], share: bool = True, min_prefix: int = 32, mb_tokens: int = 0
) -> int:
    """Token positions a trainer computes for sequences that open with the same `prefix` tokens (a group's
    prompt, an agent's preamble) and go on for `continuations` tokens each.

    Without sharing (`share` off, or a prefix shorter than `min_prefix`: trainer.share_prefixes and
    trainer.share_min_tokens) every sequence is computed whole: n * prefix + sum(continuations). With it the
    prefix is laid down once per micro-batch part: prefix + sum(continuations) when they fit in `mb_tokens`
    (trainer.max_tokens_per_mb; 0: no limit); a group too large for one is split, each part keeping the
    prefix, and a continuation too long for any part with others gets a part of its own.
    """
    n, rest = len(continuations), int(sum(continuations))
    if not share or n < 2 or prefix < max(1, min_prefix):
        return n * prefix + rest
    parts, used = 1, 0
    for c in continuations:
        if used and mb_tokens and prefix + used + c > mb_tokens:
            parts, used = parts + 1, 0
        used += c
    return parts * prefix + rest


@dataclass(frozen=True)
class ResponseLengths:
    """Long-tailed response lengths, as in reasoning traces: log-normal with this median, capped."""

    median: float
    sigma: float
    cap: int

    def quantile(self, u: float) -> int:
        """The length at probability u in (0, 1)."""
        z = NormalDist().inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
        return int(min(self.cap, max(1, round(self.median * math.exp(self.sigma * z)))))

    def for_key(self, seed: int, key: str) -> int:
        """A length fixed by (seed, key): a request keeps its length across interruption and resume."""
        return self.quantile(unit_hash(seed, key))


def unit_hash(seed: int, key: str) -> float:
    """A number in (0, 1), uniform over keys and stable across processes (unlike hash())."""
    h = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") + 0.5) / 2**64


class EmpiricalLengths:
    """Response lengths as measured in a run (its trajectories' generated lengths)."""

    def __init__(self, values):
        self.ordered = sorted(int(v) for v in values)
        if not self.ordered:
            raise ValueError("no measured response lengths to draw from")

    def quantile(self, u: float) -> int:
        return self.ordered[min(len(self.ordered) - 1, int(u * len(self.ordered)))]
