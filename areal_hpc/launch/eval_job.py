"""`areal-hpc eval --slurm`: the evaluation as a normal one-node Slurm job, checked as `render` checks a run."""

from __future__ import annotations

import copy
import os
import shlex
import sys
from pathlib import Path

import jinja2

from areal_hpc.config import Config
from areal_hpc.launch.slurm import (
    TEMPLATES,
    SlurmError,
    check_request,
    component_options,
    job_venv,
    slurm_command,
    which_slurm,
)
from areal_hpc.rundir import RunDir

EVAL_TEMPLATE = "areal_eval.sbatch.j2"


def eval_request(cfg: Config, model_folder: str, engine: str) -> Config:
    """The run's config asking for what an evaluation needs: one task on one node, this model folder, this engine."""
    job = copy.deepcopy(cfg)
    job.cluster.n_trainers, job.cluster.n_generators = 0, 0  # check_request(het=False) counts 1 + these tasks
    job.slurm.train_nodes, job.slurm.gen_nodes = 1, 0
    job.model.path, job.model.build_tiny = model_folder, False
    job.rollout.engine = engine
    return job


def render_eval_sbatch(cfg: Config, argv: list[str], run_dir: RunDir | None, check: bool = True) -> str:
    """The sbatch script running `areal-hpc eval ARGV` (paths made absolute: the job may start elsewhere)."""
    if check and which_slurm():
        check_request(cfg, het=False)
    output = str(run_dir.eval_output) if run_dir is not None else str(Path.cwd() / "areal-eval-%j.out")
    if run_dir is not None:
        run_dir.logs.mkdir(parents=True, exist_ok=True)  # sbatch opens --output before the script runs
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    env.filters["shell"] = lambda s: shlex.quote(str(s))
    command = shlex.join([sys.executable if not job_venv(cfg) else "python", "-m", "areal_hpc.cli", *argv])
    return env.get_template(EVAL_TEMPLATE).render(
        job_name=f"areal-eval-{cfg.run_name}",
        output=output,
        time=cfg.slurm.time,
        chdir=os.getcwd(),
        component_options=component_options(cfg.slurm),
        setup=list(cfg.slurm.setup),
        venv=job_venv(cfg),
        command=command,
    )


def eval_argv(model_path, data, config_path, json_path, opts: dict, overrides: list[str]) -> list[str]:
    """The job's `areal-hpc eval` arguments, paths made absolute (the job may start in another folder)."""
    from areal_hpc.evaluation.checkpoint import HELDOUT

    absolute = lambda p: str(Path(p).resolve())  # noqa: E731
    argv = ["eval", absolute(model_path), "--data", data if data == HELDOUT else absolute(data)]
    argv += ["--n-samples", str(opts["n_samples"]), "--temperature", str(opts["temperature"])]
    argv += ["--engine", opts["engine"]]
    if opts["max_new_tokens"]:
        argv += ["--max-new-tokens", str(opts["max_new_tokens"])]
    if config_path:
        argv += ["--config", absolute(config_path)]
    if json_path:
        argv += ["--json", absolute(json_path)]
    return argv + overrides


def eval_script(target, argv: list[str]) -> str:
    """The checked sbatch script evaluating `target` (evaluation.checkpoint.EvalTarget); removes its linked folder."""
    from areal_hpc.evaluation.checkpoint import pick_engine

    base = target.folder if target.run_dir is None else target.cfg.model.path
    target.close()  # the job links its own
    engine = pick_engine(argv[argv.index("--engine") + 1])
    return render_eval_sbatch(eval_request(target.cfg, str(base), engine), argv, target.run_dir)


def submit_eval_sbatch(script: str) -> str:
    """Submit the script with sbatch; returns the job id."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as f:
        f.write(script)
    try:
        return slurm_command(["sbatch", "--parsable", f.name]).strip().split(";")[0]
    finally:
        os.unlink(f.name)


__all__ = ["SlurmError", "eval_argv", "eval_request", "eval_script", "render_eval_sbatch", "submit_eval_sbatch"]
