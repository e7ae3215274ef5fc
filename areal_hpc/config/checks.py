"""Range and choice checks on a loaded run config, each failing with one line that names the key (the reward,
workflow and warm-start checks: config/checks_task.py)."""

from __future__ import annotations

import math
import re
from typing import Any

from areal_hpc.config.checks_task import check_task
from areal_hpc.config.errors import ConfigError
from areal_hpc.config.objective import check_objective
from areal_hpc.data.prompts import CHAT_TEMPLATE_MODES

# Config (areal_hpc.config) imports this module; the checks take it untyped so neither imports the other back.
Config = Any


# key -> allowed values, for string choices
_CHOICES = {
    "model.arch": ("llama", "qwen2"),
    "model.dtype": ("float32", "bfloat16"),
    "model.vocab": ("arith", "arith_tool", "arith_agent"),
    "data.operator": ("+", "*"),
    "workflow.tool": ("python", "calculator"),
    "workflow.tool_sandbox": ("bwrap", "auto", "none"),  # tool calls' isolation, as reward.sandbox's
    "data.kind": ("arithmetic", "jsonl", "parquet", "code"),
    "reward.sandbox": ("bwrap", "auto", "none"),
    "data.chat_template": CHAT_TEMPLATE_MODES,
    "rollout.engine": ("torch", "vllm", "emulated"),
    "rollout.weight_update": ("keep_kv", "recompute", "drain"),
    "ppo.adv_norm": ("none", "mean", "mean_std"),
    "ppo.adv_scope": ("group", "batch"),
    "ppo.behav_weight": ("drop", "truncate"),
    "ppo.importance": ("token", "sequence"),
    "ppo.objective": ("ppo", "cispo"),
    "ppo.adv_std": ("unbiased", "population"),
    "ppo.loss_agg": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
    "ppo.kl_estimator": ("k1", "k2", "k3"),
    "trainer.lr_schedule": ("constant", "cosine", "linear"),
    "ppo.prox": ("recompute", "loglinear"),
    "trainer.engine": ("torch", "deepspeed", "emulated"),
    "emulation.preset": ("1.5B", "7B"),
    "sync.method": ("broadcast", "disk"),
    "store.compression": ("none", "lzf", "gzip"),
    "sync.backend": ("auto", "gloo", "nccl"),
    "cluster.device": ("cpu", "cuda"),
    "slurm.mpi": ("pmix", "pmi2"),
}
# key -> (lower bound, inclusive?) for numbers
_LOWER = {
    "trainer.lora_rank": (0, True),
    "trainer.lora_alpha": (0, False),
    "model.hidden_size": (1, True),
    "model.intermediate_size": (1, True),
    "model.num_layers": (1, True),
    "model.num_heads": (1, True),
    "data.heldout_size": (0, True),
    "data.max_operand": (1, True),
    "data.min_operand": (0, True),
    "data.train_size": (1, True),
    "data.max_prompt_tokens": (0, True),
    "reward.timeout_s": (0, False),
    "reward.num_workers": (1, True),
    "reward.code_memory_mb": (64, True),
    "rollout.n_samples": (1, True),
    "rollout.temperature": (0, False),
    "rollout.top_p": (0, False),
    "rollout.max_new_tokens": (1, True),
    "rollout.batch_prompts": (1, True),
    "rollout.eta": (0, True),
    "rollout.max_running": (0, True),
    "rollout.max_num_seqs": (1, True),
    "rollout.max_concurrent_groups": (0, True),
    "workflow.max_turns": (1, True),
    "workflow.turn_discount": (0, True),
    "workflow.max_tool_calls": (0, True),
    "workflow.tool_timeout_s": (0, False),
    "workflow.agent_timeout_s": (0, False),
    "workflow.max_request_kb": (1, True),
    "workflow.tool_memory_mb": (64, True),
    "workflow.failure_window": (1, True),
    "store.shard_max_groups": (1, True),
    "store.shard_max_wait_s": (0, True),
    "rollout.kv_cache_gib": (0, False),
    "sync.bucket_mb": (1, True),
    "sync.keep_versions": (1, True),
    "sync.timeout_s": (0, False),
    "ppo.eps_clip": (0, False),
    "ppo.behav_imp_weight_cap": (0, True),
    "ppo.n_minibatches": (1, True),
    "ppo.dual_clip": (0, True),
    "ppo.kl_coef": (0, True),
    "ppo.entropy_coef": (0, True),
    "ppo.seq_reject_low": (0, True),
    "ppo.seq_reject_high": (0, True),
    "distill.coef": (0, True),
    "reward.overlong_buffer": (0, True),
    "reward.overlong_penalty": (0, True),
    "trainer.warmup_versions": (0, True),
    "trainer.lr": (0, False),
    "trainer.weight_decay": (0, True),
    "trainer.grad_clip": (0, True),
    "trainer.max_tokens_per_mb": (1, True),
    "trainer.logprob_chunk_tokens": (1, True),
    "trainer.share_min_tokens": (1, True),
    "trainer.versions": (1, True),
    "trainer.max_wall_s": (0, True),
    "trainer.warm_start_steps": (0, True),
    "trainer.warm_start_lr": (0, False),
    "trainer.warm_start_examples": (1, True),
    "trainer.warm_start_batch": (1, True),
    "trainer.max_uniform_batches": (0, True),
    "trainer.checkpoint_every": (0, True),
    "trainer.keep_checkpoints": (0, True),
    "cluster.n_generators": (1, True),
    "cluster.devices_per_generator": (1, True),
    "sync.limit_s": (0, True),
    "cluster.n_trainers": (1, True),
    "cluster.threads_per_rank": (1, True),
    "cluster.hang_timeout_s": (0, True),
    "slurm.max_restarts": (0, True),
    "slurm.train_nodes": (1, True),
    "slurm.gen_nodes": (1, True),
    "slurm.gpus_per_node": (0, True),
    "slurm.cpus_per_task": (1, True),
    "slurm.signal_s": (0, True),
    "emulation.time_scale": (0, False),
    "emulation.len_median": (0, True),
    "emulation.len_sigma": (0, True),
    "emulation.payload_mb": (0, False),
    "emulation.p_correct": (0, True),
    "logging.eval_every": (0, True),
    "logging.eval_prompts": (1, True),
    "logging.eval_n_samples": (1, True),
    "logging.eval_temperature": (0, True),
    "logging.eval_timeout_s": (0, True),
    "logging.stop_eval_s": (0, True),
}


_SLURM_TIME = re.compile(r"^(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2})$")


def slurm_time_minutes(t: str) -> float:
    """Minutes in a Slurm time: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S (as sbatch reads --time)."""
    if not _SLURM_TIME.match(t):
        raise ValueError(f"{t!r} is not a Slurm time")
    if "-" in t:
        days, rest = t.split("-", 1)
        h, m, s = ([int(x) for x in rest.split(":")] + [0, 0])[:3]
        return int(days) * 1440 + h * 60 + m + s / 60
    parts = [int(x) for x in t.split(":")]
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return parts[0] + parts[1] / 60
    return parts[0] * 60 + parts[1] + parts[2] / 60


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> Config:
    """Range and choice checks the types cannot express; raises ConfigError with one line."""
    # YAML reads on/off (and true/false) as booleans, which reach this str field as 'True'/'False'
    cfg.data.chat_template = {"True": "on", "False": "off"}.get(cfg.data.chat_template, cfg.data.chat_template)
    for key, allowed in _CHOICES.items():
        val = _get(cfg, key)
        if val not in allowed:
            raise ConfigError(f"config {key}={val!r} is not allowed; choose one of {', '.join(allowed)}")
    for key, (low, inclusive) in _LOWER.items():
        val = _get(cfg, key)
        if not math.isfinite(val):
            raise ConfigError(f"config {key}={val!r} must be a finite number")
        if (val < low) if inclusive else (val <= low):
            op = ">=" if inclusive else ">"
            raise ConfigError(f"config {key}={val!r} is out of range; it must be {op} {low}")
    if cfg.rollout.top_p > 1:
        raise ConfigError(f"config rollout.top_p={cfg.rollout.top_p!r} is out of range; it must be in (0, 1]")
    if cfg.rollout.top_p < 1:
        # the trainer recomputes logprobs under the full softmax(logits / T): a truncated sampler would make
        # every importance weight exp(prox - behav) wrong (vLLM renormalises over the top-p set; so would we)
        raise ConfigError(
            f"config rollout.top_p={cfg.rollout.top_p!r} is not supported: the trainer's logprobs are those of "
            "the full distribution; use top_p=1.0"
        )
    if cfg.data.kind in ("jsonl", "parquet", "code") and not cfg.data.path:
        raise ConfigError(f"config data.path is empty; data.kind={cfg.data.kind} needs a dataset file")
    if cfg.model.hidden_size % cfg.model.num_heads:
        raise ConfigError(
            f"config model.hidden_size={cfg.model.hidden_size} must be divisible by "
            f"model.num_heads={cfg.model.num_heads}"
        )
    if len(cfg.trainer.betas) != 2 or not all(0 <= b < 1 for b in cfg.trainer.betas):
        raise ConfigError(f"config trainer.betas={list(cfg.trainer.betas)} must be two numbers in [0, 1)")
    if not _SLURM_TIME.match(cfg.slurm.time):
        raise ConfigError(
            f"config slurm.time={cfg.slurm.time!r} is not a Slurm time; use minutes, M:S, H:M:S or D-H[:M[:S]]"
        )
    if cfg.trainer.zero_stage not in (1, 2, 3):
        raise ConfigError(f"config trainer.zero_stage={cfg.trainer.zero_stage!r} is not allowed; choose one of 1, 2, 3")
    bits = cfg.rollout.weight_bits
    if bits and not 2 <= bits <= 8:
        raise ConfigError(f"config rollout.weight_bits={bits!r} is out of range; it must be 0 (off) or in [2, 8]")
    if bits and cfg.rollout.engine != "torch":
        raise ConfigError(
            f"config rollout.weight_bits={bits} needs rollout.engine=torch (the engine that rounds its weights); "
            f"got {cfg.rollout.engine}"
        )
    devices = cfg.cluster.devices_per_generator
    if devices > 1 and cfg.rollout.engine not in ("vllm", "emulated"):
        # only vLLM splits one engine over several devices (tensor parallel); the emulated engine models it
        raise ConfigError(
            f"config cluster.devices_per_generator={devices} needs rollout.engine=vllm (or emulated); "
            f"got {cfg.rollout.engine}"
        )
    emulated = (cfg.rollout.engine == "emulated", cfg.trainer.engine == "emulated")
    if emulated[0] != emulated[1]:
        # the generators would hold a placeholder payload and the trainers real weights (or the reverse)
        raise ConfigError(
            f"config rollout.engine={cfg.rollout.engine} with trainer.engine={cfg.trainer.engine}: "
            "the emulated engines go together; set both to emulated or neither"
        )
    if cfg.emulation.p_correct > 1:
        p = cfg.emulation.p_correct
        raise ConfigError(f"config emulation.p_correct={p!r} is out of range; it must be in [0, 1]")
    from areal_hpc.costmodel import CostModel

    bad = sorted(set(cfg.emulation.cost) - (set(CostModel.__dataclass_fields__) - {"name"}))
    if bad:
        fields = ", ".join(sorted(set(CostModel.__dataclass_fields__) - {"name"}))
        raise ConfigError(f"config emulation.cost.{bad[0]} is not a cost-model field; choose from {fields}")
    logging_cfg = cfg.logging
    _check_trackers(logging_cfg.trackers)
    if not math.isfinite(logging_cfg.eval_threshold):
        raise ConfigError(
            f"config logging.eval_threshold={logging_cfg.eval_threshold!r} must be a finite number "
            "(the reward at which a held-out answer counts as correct)"
        )
    if logging_cfg.eval_temperature == 0 and logging_cfg.eval_n_samples > 1:
        raise ConfigError(
            f"config logging.eval_n_samples={logging_cfg.eval_n_samples} with logging.eval_temperature=0 (greedy) "
            "gives identical samples; set eval_temperature (to rollout.temperature) or eval_n_samples=1"
        )
    if logging_cfg.eval_temperature not in (0, cfg.rollout.temperature):
        # the generators' engines sample at rollout.temperature: held-out samples share that distribution
        raise ConfigError(
            f"config logging.eval_temperature={logging_cfg.eval_temperature!r} must be 0 (greedy) or "
            f"rollout.temperature={cfg.rollout.temperature!r}; other temperatures: areal-hpc eval on a checkpoint"
        )
    check_task(cfg)
    if cfg.data.min_operand > cfg.data.max_operand:
        raise ConfigError(
            f"config data.min_operand={cfg.data.min_operand} is above data.max_operand={cfg.data.max_operand}"
        )
    check_objective(cfg)
    _check_distill(cfg)
    if cfg.sync.backend == "nccl" and cfg.cluster.device != "cuda":
        raise ConfigError("config sync.backend=nccl needs cluster.device=cuda; use gloo (or auto) on CPU")
    return cfg


def _check_trackers(trackers: list[str]) -> None:
    """logging.trackers: known names, each once (a missing package is the launchers' check: require_trackers)."""
    from areal_hpc.trackers import TRACKERS

    for name in trackers:
        if name not in TRACKERS:
            raise ConfigError(
                f"config logging.trackers has {name!r}, which is not a tracker; choose from {', '.join(TRACKERS)} "
                "(a list, e.g. logging.trackers=[tensorboard,wandb]; [] = none)"
            )
    if len(set(trackers)) != len(trackers):
        raise ConfigError(f"config logging.trackers=[{','.join(trackers)}] names a tracker twice")


def _check_distill(cfg: Config) -> None:
    """The distillation section's combinations (docs/algorithm.md, "On-policy distillation")."""
    distill_cfg = cfg.distill
    if not distill_cfg.teacher:
        if not distill_cfg.task_reward:
            raise ConfigError("config distill.task_reward=false needs distill.teacher (nothing else would train)")
        return
    if distill_cfg.coef == 0:
        raise ConfigError("config distill.coef=0 with distill.teacher set: give a coefficient > 0 (e.g. 1.0)")
    if "emulated" in (cfg.trainer.engine, cfg.rollout.engine):
        raise ConfigError("config distill.teacher needs real engines (trainer.engine torch or deepspeed)")
    if not distill_cfg.task_reward and cfg.ppo.drop_uniform_groups:
        # the groups would still be kept or dropped by the task reward the run turned off
        raise ConfigError(
            "config distill.task_reward=false needs ppo.drop_uniform_groups=false: without a task reward every "
            "group carries the teacher's signal"
        )
