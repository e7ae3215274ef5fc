"""Typed run configuration: dataclasses per part, loaded from YAML with dotted overrides (OmegaConf)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_hpc.config.checks import ConfigError, slurm_time_minutes, validate  # noqa: F401  (re-exported)
from areal_hpc.config.cluster import ClusterConfig, EmulationConfig, SlurmConfig
from areal_hpc.config.files import map_deprecated_keys, quote_advice, read_config_file, text_read_as_yaml
from areal_hpc.config.task import DataConfig, RewardConfig, WorkflowConfig  # noqa: F401
from areal_hpc.plugins import absolute_spec
from areal_hpc.trackers import DEFAULT_TRACKERS


@dataclass
class ModelConfig:
    """The policy model: a local Hugging Face folder, or a tiny model built there for the demos."""

    path: str = MISSING  # a local Hugging Face folder (config.json, safetensors, tokenizer files)
    # build a tiny model + tokenizer into `path` if it does not exist, or copy the same build from
    build_tiny: bool = False  # ~/.cache/areal-hpc/tiny-models (AREAL_HPC_TINY_CACHE moves it; empty: off)
    arch: str = "llama"  # tiny-model architecture: llama | qwen2
    # tiny-model vocabulary: arith | arith_tool (the tool demo's code fences) | arith_agent (the agent demo's calls)
    vocab: str = "arith"
    hidden_size: int = 128  # tiny model: hidden width (a multiple of num_heads)
    intermediate_size: int = 512  # tiny model: MLP width
    num_layers: int = 2  # tiny model: transformer layers
    num_heads: int = 4  # tiny model: attention heads (as many key/value heads)
    # float32 | bfloat16: the generators' weights, and the dtype trainer 0 publishes them in (trainers keep
    # fp32 master weights whatever this says)
    dtype: str = "float32"


@dataclass
class RolloutConfig:
    """Generation: the engine, sampling, the batch and its staleness bound, and how new weights are loaded."""

    engine: str = "torch"  # torch | vllm | emulated (with trainer.engine=emulated: docs/emulation.md)
    n_samples: int = 8  # samples per prompt (group size)
    temperature: float = 1.0  # sampling temperature (> 0); behaviour logprobs are those of softmax(logits / T)
    # must be 1.0: the trainer recomputes logprobs of the full distribution, so a truncated sampler is refused
    top_p: float = 1.0
    max_new_tokens: int = 8  # most new tokens per model call (an episode's turn); an answer cut off there scores 0
    batch_prompts: int = 32  # B: prompts (groups) per training step
    eta: int = 4  # staleness bound in versions; 0 = synchronous
    max_running: int = 0  # most prompts in flight over all generators, set by rank 0 (0 = only the eta bound)
    # new weights on a generator with requests in flight (docs/architecture.md, "Weight loads"):
    # keep_kv = load between two engine steps, running requests keep their KV cache and go on (nothing redone);
    # recompute = interrupt them, load, prefill prompt + partial again under the new weights (AReaL's design);
    # drain = stop admitting, let them finish, then load
    weight_update: str = "keep_kv"
    interrupt: bool | None = None  # deprecated: true = weight_update=recompute, false = drain
    max_num_seqs: int = 256  # sequences one engine step holds (vLLM's max_num_seqs): the engine's slots
    # most groups a generator has in flight (AReaL's max_concurrent_rollouts); it asks for a group whenever a
    # slot is free. 0 = max_num_seqs: even if every slot holds the last, long answer of a different group,
    # there is room to keep the engine full
    max_concurrent_groups: int = 0
    kv_cache_gib: float = 1.0  # engine=vllm: KV cache per generator rank (host memory on CPU, GPU memory on cuda)
    # engine=torch, to study a training-inference mismatch (docs/algorithm.md): the generators round every weight
    # matrix to this many bits per output row on each load (fake quantization, as a quantized rollout does;
    # no speed-up). 0 = off
    weight_bits: int = 0
    workflow: str | None = None  # deprecated: workflow.fn


@dataclass
class PPOConfig:
    """The decoupled PPO objective (docs/algorithm.md)."""

    eps_clip: float = 0.2  # the policy ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]
    eps_clip_high: float | None = None  # the upper clip (DAPO's clip-higher: 0.28); null = eps_clip
    dual_clip: float = 0.0  # dual-clip PPO: a token with A < 0 loses at most dual_clip x |A| (> 1, e.g. 3); 0 = off
    # the behaviour importance weight's cap (proximal / behaviour probability); 0 = no cap
    behav_imp_weight_cap: float = 5.0
    # a token whose behaviour weight is over the cap: drop (leaves the loss) | truncate (its weight is the cap: TIS)
    behav_weight: str = "drop"
    # sequence rejection (verl's / OpenRLHF's sequence mask): every loss token of a sequence whose geometric-mean
    # behaviour weight exp(mean log(pi_prox / pi_behav)) is below this leaves the loss (metrics:
    # seq_rejected_frac); in (0, 1), e.g. 0.5; 0 = off; needs decoupled=true
    seq_reject_low: float = 0.0
    seq_reject_high: float = 0.0  # sequence rejection's upper bound: above 1, e.g. 2; 0 = off
    # token = per-token ratios (PPO) | sequence = the length-normalised sequence ratio, clipped per sequence (GSPO)
    importance: str = "token"
    # the policy loss: ppo (the clipped ratio) | cispo (MiniMax-M1: the clipped ratio, stop-gradiented, weighs every
    # token's log-probability, so clipped tokens keep a gradient; eps_clip / eps_clip_high bound it)
    objective: str = "ppo"
    # how token losses add up: token_mean (over the minibatch's tokens) | seq_mean_token_mean (per sequence, then
    # over sequences) | seq_mean_token_sum_norm (Dr.GRPO: summed, / (sequences x rollout.max_new_tokens))
    loss_agg: str = "token_mean"
    kl_coef: float = 0.0  # KL penalty to the reference policy (the weights at version 0); 0 = no reference held
    kl_estimator: str = "k3"  # k1 | k2 | k3: Schulman's estimators of KL(policy || reference)
    entropy_coef: float = 0.0  # entropy bonus (0 = none)
    n_minibatches: int = 4  # optimizer steps per version: the batch is split into this many PPO minibatches
    # advantage: none (the reward) | mean (reward - mean) | mean_std (then / std); the statistics come from
    # the prompt's group or the whole batch (adv_scope)
    adv_norm: str = "mean_std"
    adv_scope: str = "group"  # group (GRPO) | batch: where adv_norm's mean and std are taken
    # mean_std's standard deviation: unbiased (divided by n - 1, as AReaL, verl and TRL) | population (by n); a
    # one-sample group's advantage is 0
    adv_std: str = "unbiased"
    drop_uniform_groups: bool = True  # dynamic sampling: skip groups with all-equal rewards
    # proximal logprobs: recompute (a forward pass of the current weights) | loglinear (interpolated between
    # behaviour and current logprobs, no extra pass)
    prox: str = "recompute"
    # false: plain PPO against the behaviour policy (the paper's baseline): the ratio is taken to the
    # behaviour logprobs, with no proximal policy, no behaviour weight and no proximal recompute
    decoupled: bool = True


@dataclass
class DistillConfig:
    """On-policy distillation (docs/algorithm.md): a frozen teacher on the trainers scores every sampled token."""

    # the teacher: a Hugging Face folder or a trainer checkpoint of this project (RUN_DIR/checkpoints/vN), with
    # the student's tokenizer (checked at start-up); any size. "" = no distillation
    teacher: str = ""
    # per loss token the advantage gains coef x (log p_teacher - log p_behaviour): the reverse KL's per-token sample
    coef: float = 1.0
    # false: the task advantage is zeroed and the teacher's term alone trains (needs ppo.drop_uniform_groups=false)
    task_reward: bool = True
    # sample: the term above, the sampled token's gap as an advantage | full: no advantage term; the loss gains
    # coef x KL(student || teacher) over the whole vocabulary at each loss token, weighted by the loss's
    # aggregation (no clip, behaviour weight or rejection; exact: no sampling noise; one teacher body forward per
    # micro-batch; not under DeepSpeed ZeRO-3 without LoRA)
    estimator: str = "sample"


@dataclass
class TrainerConfig:
    """Training: the engine, the optimizer, the run's length, the warm start and checkpoints."""

    engine: str = "torch"  # torch | deepspeed | emulated (with rollout.engine=emulated)
    lr: float = 2e-5  # AdamW learning rate (the peak, under a schedule)
    # constant | cosine | linear: after the warm-up, decays from lr towards 0 over trainer.versions
    lr_schedule: str = "constant"
    warmup_versions: int = 0  # the learning rate rises linearly to lr over this many versions (0 = none)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas, two numbers in [0, 1)
    weight_decay: float = 0.05  # AdamW weight decay
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 = no clipping)
    max_tokens_per_mb: int = 4096  # token budget of one micro-batch (a longer sequence gets one to itself)
    versions: int = 100  # training steps (policy versions) to run
    # stop after this many seconds of RL (0 = no limit), counted in each launch from when its starting weights
    # are published: loading the model and the warm start come before it; periodic held-out evaluations run
    # inside it; the version on the trainers when it ends, the last checkpoint and the final evaluation
    # (bounded by logging.eval_timeout_s) come after it
    max_wall_s: float = 0.0
    warm_start_steps: int = 0  # supervised steps on each row's warm_start_template target before RL (0 = none)
    warm_start_lr: float = 1e-3  # warm start: learning rate
    warm_start_examples: int = 1000  # warm start: the first this many training problems are its examples
    warm_start_batch: int = 64  # warm start: examples per step
    # warm start: the text it trains the model to write for a row: {answer} is the reference answer
    # (data.answer_key; after '####' when there is one), {name} any other field, {{ }} literal braces. "" = the
    # built-in math reward's form, \boxed{{{answer}}} (data.kind=code has no default: name a solution field).
    # A row without a named field stops the run at start-up (docs/workflows.md, The warm start)
    warm_start_template: str = ""
    # stop the run (with a non-zero exit) when this many batches' worth of groups (x rollout.batch_prompts) in a
    # row had all-equal rewards and no version trained meanwhile: a run that cannot learn (0 = never)
    max_uniform_batches: int = 20
    checkpoint_every: int = 0  # versions between checkpoints (0 = only at the end)
    # complete checkpoints kept: once one is complete, rank 0 deletes those older than the newest
    # keep_checkpoints (0 = keep all). 3: the newest (the one a resume takes), the one before it (what a
    # resume falls back to when the newest is damaged: docs/reliability.md) and one more for a problem
    # noticed a checkpoint late, where keeping all of a long run costs terabytes (a 1.5B model with its
    # optimizer state is ~22 GB per checkpoint: areal_hpc/disk_estimate.py)
    keep_checkpoints: int = 3
    seed: int = 1  # random seed of training and sampling (each generator adds 1000 x its rank)
    zero_stage: int = 2  # trainer.engine=deepspeed: ZeRO stage 1, 2 or 3
    bf16: bool = False  # bf16 compute on fp32 master weights (torch: autocast; deepspeed: its bf16 mode)
    packing: bool = True  # padding-free micro-batches (false: right-padded, the old path, for comparison)
    # compute each shared token prefix once (a group's prompt, a workflow's earlier turns, an agent's preamble):
    # laid down once per micro-batch, its continuations attend to it (docs/prefix-sharing.md); needs packing
    share_prefixes: bool = True
    share_min_tokens: int = 32  # the shortest common prefix laid down once (shorter ones are computed per sequence)
    logprob_chunk_tokens: int = 256  # positions whose full-vocabulary logits exist at once
    gradient_checkpointing: bool = False  # recompute each layer's activations in backward
    lora_rank: int = 0  # LoRA: train and publish a rank-r adapter on a frozen base (0 = train every weight)
    lora_alpha: float = 32.0  # LoRA: the adapter's update B A is scaled by lora_alpha / lora_rank
    lora_targets: list[str] = field(default_factory=list)  # LoRA: layers by name (q_proj, ...); [] = all linear


@dataclass
class StoreConfig:
    """Where a run's files go (docs/run-dir.md), and how generators write their rollouts as shards."""

    run_dir: str = "runs/${run_name}"  # the run directory; under Slurm every node must see it
    # a generator writes its scored groups as one shard when this many are waiting, or when the oldest has
    # waited shard_max_wait_s, or when nothing else of its is in flight: few files on a shared filesystem,
    # little delay for the trainers
    shard_max_groups: int = 16
    shard_max_wait_s: float = 0.5  # seconds the oldest scored group waits at most before its shard is written
    # HDF5 filter on the shards' token columns, after a byte shuffle: none | lzf (2.2-2.3x smaller) | gzip
    # (level 1: 2.4-2.6x; every HDF5 tool reads it, lzf needs h5py's filter). none by default: either
    # filter doubles to triples a shard's write + read time (lzf +17 ms, gzip +27-40 ms per 2 MB shard;
    # benchmarks/store_io.py --compression, docs/run-dir.md). Compressed and uncompressed shards read alike
    compression: str = "none"


@dataclass
class SyncConfig:
    """How trainer 0 sends the new weights to every generator after each version."""

    # broadcast = a collective from trainer 0 to the generators, in pre-allocated buckets; disk = safetensors
    # files under RUN_DIR/weights/v{N}/ that the generators load
    method: str = "broadcast"
    backend: str = "auto"  # broadcast: auto (nccl on cuda, else gloo) | gloo | nccl (needs cluster.device=cuda)
    bucket_mb: int = 64  # broadcast: MB per pre-allocated bucket; the weights go in as many as they fill
    # crc32 of the weights sent and of the weights loaded, after every version, in metrics.csv (a pass over
    # all weights on both ends: cheap on small models, off in the GPU recipes)
    checksum: bool = True
    keep_versions: int = 3  # disk: newest weight folders kept under RUN_DIR/weights/ (older ones are deleted)
    # seconds a collective (the weight broadcast, the trainers' all-reduce) waits for the other ranks before
    # it fails; under Slurm cut to end a minute before the allocation does
    timeout_s: float = 1800.0
    # seconds each step of one weight sync may take (trainer 0's send, a vLLM worker's receive + load) before the
    # run stops with one line naming the step, the version and the ranks, and restarts (slurm.max_restarts).
    # 0 = derived from the model's bytes: 60 s + 1 s per 50 MB, 4x for a world's first sync
    limit_s: float = 0.0


@dataclass
class LoggingConfig:
    """What a run records and shows: experiment trackers, held-out evaluation, the progress bar."""

    # where metrics.csv's rows, the config and the summary also go: tensorboard (RUN_DIR/tensorboard/) | wandb
    # (offline unless WANDB_MODE is set: RUN_DIR/wandb/) | mlflow (RUN_DIR/mlruns/ or mlflow_uri); [] = none.
    # wandb and mlflow need the trackers extra (docs/analysis.md)
    trackers: list[str] = field(default_factory=lambda: list(DEFAULT_TRACKERS))
    experiment: str = "areal-hpc"  # the W&B project and the MLflow experiment the run is filed under
    mlflow_uri: str = ""  # an MLflow tracking URI (a server, sqlite:///...); '' = a file store at RUN_DIR/mlruns/
    tensorboard: bool | None = None  # deprecated: false = logging.trackers without tensorboard, true = with it
    eval_every: int = 10  # versions between held-out evaluations (0 = only first and last)
    eval_prompts: int = 500  # held-out prompts evaluated (at most data.heldout_size)
    eval_n_samples: int = 1  # samples per held-out prompt; the logged accuracy is avg@k (pass@1 over k samples)
    eval_temperature: float = 0.0  # 0 = greedy (then eval_n_samples must be 1); else must equal rollout.temperature
    # a held-out episode counts as correct when its reward is >= this: the accuracy (heldout_acc, acc_*, eval's
    # pass@k) is the share of correct episodes; the mean reward (heldout_reward_mean) is logged beside it
    eval_threshold: float = 1.0
    # a held-out evaluation ends after this many seconds with the episodes it has: the unfinished ones are cut,
    # counted (heldout_cut, the summary's heldout_cut_*) and left out of its accuracy and mean reward (0 = no bound)
    eval_timeout_s: float = 600.0
    # after a stop request (Ctrl-C, SIGTERM, the stop file, Slurm's signal) the final evaluation gets at most this
    # many seconds, cut as above (0 = it is skipped)
    stop_eval_s: float = 30.0
    progress: bool = True  # a progress bar on the terminal (areal-hpc run --no-progress: false)


def concurrent_groups(rc: RolloutConfig) -> int:
    """Groups one generator keeps in flight (rollout.max_concurrent_groups, or its default)."""
    return rc.max_concurrent_groups or rc.max_num_seqs


@dataclass
class Config:
    """A run's whole configuration: its name and one section per part."""

    # the run's name: store.run_dir defaults to runs/<run_name>, and the Slurm job is named areal-<run_name>
    run_name: str = "demo"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def _one_line(err: Exception, overrides: list[str] | None = None) -> str:
    msg = str(err).strip().splitlines()[0]
    key = getattr(err, "full_key", None)
    if not key:  # some errors (a tuple of the wrong length) lose the key: find the override that fails alone
        for ov in overrides or []:
            try:
                OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist([ov]))
            except (OmegaConfBaseException, TypeError):
                key = ov.split("=", 1)[0]
                break
    if key and (line := text_read_as_yaml(key, msg, overrides)):
        return line
    if key and "incompatible container types" in msg:  # a mapping where the default is a list or a value
        return f"config {key} takes a value or a list in brackets, not a mapping in braces (quote text with braces)"
    if key and "is not a ListConfig" in msg:  # a single value where a list goes (logging.trackers=wandb)
        return f"config {key} must be a list in brackets, e.g. {key}=[a,b] ([] = empty)"
    return f"config {key}: {msg}" if key else f"config: {msg}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- dotted `key=value` overrides, type-checked and validated."""
    try:
        schema = OmegaConf.structured(Config)
        layers = [schema]
        if path is not None:
            layers += read_config_file(path)
        n_files = len(layers) - 1
        for ov in overrides or []:
            if "=" not in ov:
                raise ConfigError(f"override {ov!r} must look like key=value (e.g. rollout.eta=2)")
            try:
                layers.append(OmegaConf.from_dotlist([ov]))
            except (yaml.YAMLError, ValueError):
                key, value = ov.split("=", 1)
                advice = f"; {quote_advice(key, value)}" if any(c in value for c in "{}[]:") else ""
                raise ConfigError(f"override {ov!r} has a value that is not valid YAML{advice}") from None
        merged = OmegaConf.merge(*layers)
        OmegaConf.resolve(merged)
        map_deprecated_keys(merged, layers[1:], n_files)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"config {missing[0]} is required but not set")
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except (OmegaConfBaseException, TypeError) as err:
        # TypeError: OmegaConf merging a mapping into an untyped (Any) key that holds a list, or the reverse
        raise ConfigError(_one_line(err, overrides)) from None
    cfg = validate(cfg)
    # a file given relative to where the run was started: every rank, on any node, finds the same one
    fn = cfg.reward.fn
    cfg.reward.fn = [absolute_spec(f) for f in fn] if isinstance(fn, list) else absolute_spec(fn)
    cfg.workflow.fn = absolute_spec(cfg.workflow.fn)
    cfg.workflow.agent = absolute_spec(cfg.workflow.agent) if cfg.workflow.agent else ""
    for dotted in PATH_KEYS:
        section, key = dotted.split(".")
        sub = getattr(cfg, section)
        setattr(sub, key, absolute_path(getattr(sub, key)))
    return cfg


# every config value that names a file or folder: written absolute into a run's config, so a job script
# submitted from another directory (or a resume from anywhere) finds what the user meant where they typed it
PATH_KEYS = ("model.path", "data.path", "store.run_dir", "slurm.venv", "distill.teacher")


def absolute_path(value: str) -> str:
    """`value` as an absolute path from the current directory ('' stays '': unset)."""
    return os.path.abspath(os.path.expanduser(value)) if value else value


def to_yaml(cfg: Config) -> str:
    tree = OmegaConf.to_container(OmegaConf.structured(cfg))
    tree["rollout"].pop("interrupt")  # deprecated and always mapped away on load: a written config has only the mode
    tree["logging"].pop("tensorboard")  # deprecated likewise: logging.trackers says it
    tree["rollout"].pop("workflow")  # renamed: workflow.fn says it
    return OmegaConf.to_yaml(tree)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config atomically (the run directory's record of what ran)."""
    from areal_hpc.utils import atomic_write_text

    atomic_write_text(Path(path), to_yaml(cfg))
