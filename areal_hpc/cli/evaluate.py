"""`areal-hpc eval` (a checkpoint or a Hugging Face folder on held-out data, here or as a Slurm job) and `export`."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import click

from areal_hpc.config import ConfigError


@click.command("eval")
@click.argument("model_path", type=click.Path(file_okay=False))
@click.option(
    "--data", default="heldout", show_default=True, help="'heldout' (the run's held-out prompts) or FILE.jsonl/.parquet"
)
@click.option(
    "--config", "config_path", type=click.Path(dir_okay=False), help="Data/prompt settings (default: the run's)."
)
@click.option("--n-samples", default=1, show_default=True, type=int, help="Answers per problem (avg@k, pass@k).")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--max-new-tokens", type=int, help="Default: the config's rollout.max_new_tokens.")
@click.option("--engine", type=click.Choice(["auto", "vllm", "torch"]), default="auto", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the figures as JSON here.")
@click.option("--slurm", is_flag=True, help="Print this evaluation as an sbatch script instead of running it.")
@click.option("--submit", is_flag=True, help="With --slurm: submit it with sbatch.")
@click.option("--verbose", is_flag=True, help="Show the engine's own log (vLLM's); by default only the answer.")
@click.argument("overrides", nargs=-1)
def eval_cmd(
    model_path,
    data,
    config_path,
    n_samples,
    temperature,
    max_new_tokens,
    engine,
    json_path,
    slurm,
    submit,
    verbose,
    overrides,
):
    """Evaluate RUN_DIR/checkpoints/vN or a Hugging Face folder: pass@1 as avg@k (+- standard error), pass@k, the
    mean reward (correct: reward >= logging.eval_threshold)."""
    from areal_hpc.evaluation import checkpoint
    from areal_hpc.model import ModelFolderError
    from areal_hpc.workflow import TooManyFailures

    try:
        target = checkpoint.resolve(model_path, config_path, list(overrides), data)
        if slurm:
            opts = dict(n_samples=n_samples, temperature=temperature, engine=engine, max_new_tokens=max_new_tokens)
            _eval_job(target, model_path, data, config_path, json_path, submit, overrides, opts)
            return
        try:
            # the user's one line, said before any engine ran; a ValueError or OSError from the engine (memory,
            # max_model_len, its files) keeps its log: the one line alone would not say enough
            refusals = (ConfigError, ModelFolderError, checkpoint.EvalError)
            with contextlib.nullcontext() if verbose else _engine_log_aside(refusals):
                out = checkpoint.run_eval(target, data, n_samples, temperature, max_new_tokens, engine)
        finally:
            target.close()
    except (ConfigError, ModelFolderError, OSError, ValueError, TooManyFailures) as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    for line in checkpoint.summary_lines(out):
        click.echo(line)
    if json_path:
        checkpoint.write_json(out, json_path)
        click.echo(f"wrote {json_path}")


@contextlib.contextmanager
def _engine_log_aside(refusals: tuple[type[Exception], ...]):
    """Everything written to file descriptors 1 and 2 meanwhile goes to a temporary file: vLLM logs from Python,
    C++ and its progress bars, to stdout and stderr alike, and only the descriptors catch all of it. The file is
    deleted, unless something other than a refusal (one of `refusals`, the user's one line) went wrong."""
    log = tempfile.NamedTemporaryFile("wb", prefix="areal-eval-", suffix=".log", delete=False)
    _flush()
    saved = [os.dup(1), os.dup(2)]
    keep = False
    try:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        yield
    except refusals:
        raise
    except BaseException:
        keep = True
        raise
    finally:
        _flush()
        for fd, kept in zip((1, 2), saved):
            os.dup2(kept, fd)
            os.close(kept)
        log.close()
        if keep:
            print(f"the engine's log (eval --verbose shows it): {log.name}", file=sys.stderr)
        else:
            os.unlink(log.name)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def _eval_job(target, model_path, data, config_path, json_path, submit, overrides, opts) -> None:
    """`eval --slurm`: the same evaluation as a sbatch script (printed, or submitted with --submit)."""
    from areal_hpc.launch.eval_job import SlurmError, eval_argv, eval_script, submit_eval_sbatch

    argv = eval_argv(model_path, data, config_path, json_path, opts, list(overrides))
    try:
        script = eval_script(target, argv)
        click.echo(f"submitted job {submit_eval_sbatch(script)}" if submit else script, nl=submit)
    except SlurmError as err:
        raise click.ClickException(str(err)) from None


@click.command("export")
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path())
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="Weights' dtype; auto: the run's model folder's (the trainer's own are float32).",
)
@click.option("--adapter", is_flag=True, help="A LoRA checkpoint: write the adapter alone, in PEFT's format.")
def export_cmd(checkpoint, out_dir, dtype, adapter):
    """Write RUN_DIR/checkpoints/vN (torch, DeepSpeed ZeRO shards, or a LoRA adapter merged into its base) as a
    Hugging Face folder OUT_DIR, on CPU."""
    from areal_hpc.model.export import ExportError, export_checkpoint

    try:
        echo = lambda line: click.echo(line, err=True)  # noqa: E731
        done = export_checkpoint(checkpoint, out_dir, dtype, progress=echo, adapter_only=adapter)
    except (ConfigError, ExportError, OSError, ValueError) as err:  # ValueError: a model folder transformers refuses
        raise click.ClickException(str(err).splitlines()[0]) from None
    click.echo(done.summary())
