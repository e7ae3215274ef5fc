"""`areal-hpc eval`: a checkpoint or Hugging Face folder on a data set, reported as papers do (avg@k, pass@k)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.config import Config, load_config
from areal_hpc.model.checkpoints import adapter_base_folder, is_lora_checkpoint, run_model_folder, run_of_checkpoint
from areal_hpc.rundir import WEIGHTS_FILE, RunDir

HELDOUT = "heldout"  # --data value: the run's own held-out prompts (what it logged as heldout_acc, heldout_reward_mean)


class EvalError(ValueError):
    """A model path or data set eval cannot use; one line saying what is wrong and what is allowed."""


@dataclass
class EvalTarget:
    """What is evaluated: a loadable HF folder, the config its prompts come from, and where it came from."""

    folder: Path  # config.json, weights, tokenizer (a checkpoint's weights linked beside its base model's files)
    cfg: Config
    run_dir: RunDir | None  # the run a checkpoint belongs to
    version: int | None  # the checkpoint's policy version

    def close(self) -> None:
        """Remove the linked folder made for a checkpoint (never a user's HF folder)."""
        if self.run_dir is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def resolve(
    path: str, config_path: str | None = None, overrides: list[str] | None = None, data: str | None = None
) -> EvalTarget:
    """An HF folder (config.json + weights + tokenizer), a torch trainer's checkpoint in RUN_DIR/checkpoints/vN, or
    a LoRA checkpoint of either trainer (its adapter merged into the base, in a temporary folder).

    The model comes from `path` (a checkpoint: its run's model folder) and a `data` file fills data.path, so
    a recipe whose model.path and data.path are left to the user (jobs/math_1p5b_gpu.yaml) serves as --config.
    """
    p = Path(path).resolve()
    if not p.is_dir():
        where = RunDir("RUN_DIR").trainer_checkpoint(0).with_name("vN")
        raise EvalError(f"{path!r} is not a folder; give a run's checkpoint ({where}) or a Hugging Face model folder")
    found = run_of_checkpoint(p)
    run, version = found if found else (None, None)
    if config_path is None and run is not None:
        config_path = str(run.config)
    # a LoRA checkpoint: its adapter merged into the base it trained on, whose config and tokenizer it takes
    lora = run is not None and is_lora_checkpoint(p)
    model_dir = p if run is None else adapter_base_folder(run) if lora else run_model_folder(run)
    # the user's overrides come last: model.path=... still points a checkpoint at a model folder that moved
    model_ov = [f"model.path={model_dir}", "model.build_tiny=false"]
    data_ov = [f"data.path={Path(data).resolve()}"] if data not in (None, HELDOUT) else []
    cfg = load_config(config_path, model_ov + data_ov + list(overrides or []))
    if run is None:
        from areal_hpc.model import check_model_folder

        return EvalTarget(check_model_folder(p), cfg, None, None)
    if not lora and not (p / WEIGHTS_FILE).is_file():
        raise EvalError(
            f"checkpoint {str(p)!r} has no model.safetensors (a DeepSpeed checkpoint?); "
            f"export it first (areal-hpc export {path} OUT_DIR) and evaluate OUT_DIR"
        )
    base = Path(cfg.model.path).resolve()
    if not (base / "config.json").is_file():
        raise EvalError(f"checkpoint {str(p)!r}: its run's model folder {str(base)!r} (model.path) has no config.json")
    # the base folder's config, tokenizer and generation config with the checkpoint's weights: no copy
    folder = Path(tempfile.mkdtemp(prefix="areal-eval-"))
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".safetensors.index.json")):
            os.symlink(f, folder / f.name)
    if lora:
        from safetensors.torch import save_file

        from areal_hpc.engines.lora import read_merged
        from areal_hpc.model import untied

        save_file(untied(read_merged(p, base)), str(folder / WEIGHTS_FILE))
    else:
        os.symlink(p / WEIGHTS_FILE, folder / WEIGHTS_FILE)
    return EvalTarget(folder, cfg, run, version)


def pick_engine(name: str) -> str:
    """auto: vLLM when it is installed (production), else the torch engine."""
    if name == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "torch"
    return name


def eval_problems(target: EvalTarget, data: str, tokenizer):
    """The run's held-out prompts (as many as it evaluated), or every row of a jsonl/parquet file."""
    from areal_hpc.data import load_run_dataset

    cfg = target.cfg
    if data == HELDOUT:
        ds = load_run_dataset(cfg, tokenizer)
        return ds.heldout[: cfg.logging.eval_prompts], ds.too_long
    f = Path(data)
    kinds = {".jsonl": "jsonl", ".parquet": "parquet"}
    if f.suffix not in kinds:
        raise EvalError(f"--data {data!r} must be {HELDOUT!r} (the run's held-out prompts) or a .jsonl/.parquet file")
    if not f.is_file():
        raise EvalError(f"--data {data!r} does not exist")
    kind = "code" if cfg.data.kind == "code" and f.suffix == ".jsonl" else kinds[f.suffix]  # a code run's tasks
    cfg.data.kind, cfg.data.path, cfg.data.heldout_size = kind, str(f), 0  # every row is evaluated
    ds = load_run_dataset(cfg, tokenizer)
    return ds.train, ds.too_long


def run_eval(
    target: EvalTarget,
    data: str,
    n_samples: int,
    temperature: float,
    max_new_tokens: int | None,
    engine: str = "auto",
    seed: int = 0,
) -> dict:
    """Generate n_samples answers per problem, score them with the training reward, return the figures."""
    from areal_hpc.data.prompts import check_context
    from areal_hpc.engines import make_generation_engine
    from areal_hpc.evaluation import evaluate
    from areal_hpc.model import load_tokenizer
    from areal_hpc.reward import reward_pool_for
    from areal_hpc.workflow import load_workflow, runner_settings

    if temperature < 0 or n_samples < 1:
        raise EvalError(f"--temperature must be >= 0 and --n-samples >= 1, got {temperature} and {n_samples}")
    if temperature == 0 and n_samples > 1:
        raise EvalError(f"--temperature 0 (greedy) gives one answer per problem; --n-samples {n_samples} needs T > 0")
    cfg = target.cfg
    if cfg.cluster.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # a GPU recipe as --config on a login node
            raise EvalError(
                "config cluster.device=cuda but no GPU is visible here; run it on a GPU node (--slurm) "
                "or add cluster.device=cpu"
            )
    mnt = max_new_tokens or cfg.rollout.max_new_tokens
    tokenizer = load_tokenizer(target.folder)
    problems, too_long = eval_problems(target, data, tokenizer)
    check_context(target.folder, max(len(p.prompt_ids) for p in problems), mnt, "the longest evaluated")
    cfg.rollout.max_new_tokens = mnt
    settings = runner_settings(cfg, tokenizer, target.folder)
    flow = load_workflow(cfg.workflow.fn)  # a tool-using policy is evaluated with its tool; checked first
    name = pick_engine(engine)
    extra = {"kv_cache_gib": cfg.rollout.kv_cache_gib} if name == "vllm" else {}
    # the run's reward (math-verify, or code in its sandbox) first: a sandbox that cannot run refuses
    # before the engine loads
    with reward_pool_for(cfg) as pool:
        t0 = time.time()
        eng = make_generation_engine(
            name,
            model_path=str(target.folder),
            temperature=temperature or 1.0,  # greedy requests ignore it
            dtype=cfg.model.dtype,
            seed=seed,
            device=cfg.cluster.device,
            max_num_seqs=cfg.rollout.max_num_seqs,
            **extra,
        )
        t_gen = time.time()
        try:
            thr = cfg.logging.eval_threshold  # correct: reward >= it, as the run's held-out accuracy counts
            res = evaluate(eng, tokenizer, pool, problems, settings, n_samples, temperature == 0, flow, thr)
        finally:
            eng.close()
    t_end = time.time()
    return {
        "model": str(target.folder if target.run_dir is None else target.run_dir.trainer_checkpoint(target.version)),
        "version": target.version,
        "data": data,
        "workflow": cfg.workflow.fn,
        "engine": name,
        "temperature": temperature,
        "max_new_tokens": mnt,
        "skipped_too_long": too_long,
        **res.as_dict(),
        "engine_start_s": t_gen - t0,
        "eval_s": t_end - t_gen,
    }


def summary_lines(out: dict) -> list[str]:
    k = out["n_samples"]
    passes = ", ".join(f"pass@{kk} {v:.1%}" for kk, v in out["pass_at_k"].items() if kk != "1")
    what = f"{out['n_problems']} problems x {k} sample(s) at T={out['temperature']:g}"
    return [
        f"model:     {out['model']}" + (f" (version {out['version']})" if out["version"] is not None else ""),
        f"data:      {out['data']}: {what}, max {out['max_new_tokens']} new tokens, engine {out['engine']}",
        f"pass@1:    {out['avg_at_k']:.1%} +- {out['avg_at_k_stderr']:.1%} (avg@{k}, standard error over problems)"
        + (f"; {passes}" if passes else ""),
        f"reward:    {out['reward_mean']:.3f} mean; an answer counts as correct at reward >= {out['threshold']:g} "
        "(logging.eval_threshold)",
        f"answers:   {out['mean_response_tokens']:.1f} tokens on average, {out['truncated_share']:.1%} truncated"
        + (f", {out['tool_share']:.1%} called a tool" if out.get("tool_share") else ""),
        f"time:      {out['eval_s']:.1f} s to generate and score ({out['engine_start_s']:.1f} s engine start)",
    ]


def write_json(out: dict, path: str) -> None:
    from areal_hpc.utils import atomic_write_text

    atomic_write_text(Path(path), json.dumps(out, indent=1))
