"""Runs on Slurm: `areal-hpc render`, `submit`, `sweep`, `collect`, `status`, `cancel` (and the script's `prepare`)."""

from __future__ import annotations

from pathlib import Path

import click

from areal_hpc.cli.common import load_or_fail
from areal_hpc.rundir import RunDir


@click.command("render")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--check/--no-check", default=True, help="Check the request against the cluster (sinfo) first.")
def render_cmd(config_path: str, overrides: tuple[str, ...], check: bool) -> None:
    """Print the heterogeneous-job sbatch script for CONFIG_PATH [KEY=VALUE ...] (submit it with sbatch)."""
    from areal_hpc.launch.request_checks import check_all
    from areal_hpc.launch.slurm import SlurmError, render_sbatch, which_slurm

    cfg = load_or_fail(config_path, overrides)
    try:
        check_all(cfg, "render", cluster=check and which_slurm(), target=True)  # every problem, nothing written
        script = render_sbatch(cfg, " ".join([config_path, *overrides]))
    except SlurmError as err:
        raise click.ClickException(str(err)) from None
    # sbatch opens the job's output file in RUN_DIR/logs before the script runs: it must exist
    RunDir(Path(cfg.store.run_dir).resolve()).logs.mkdir(parents=True, exist_ok=True)
    click.echo(script, nl=False)
    click.echo(disk_line(cfg), err=True)  # stderr: stdout is the script


@click.command("submit")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def submit_cmd(config_path: str, overrides: tuple[str, ...]) -> None:
    """Submit CONFIG_PATH [KEY=VALUE ...] as a heterogeneous Slurm job through submitit."""
    from areal_hpc.launch.local import RunFailed
    from areal_hpc.launch.request_checks import refusal_text
    from areal_hpc.launch.slurm import SlurmError
    from areal_hpc.launch.submit import submit

    cfg = load_or_fail(config_path, overrides)
    try:
        job = submit(cfg)
    except (SlurmError, RunFailed, ValueError, OSError) as err:
        raise click.ClickException(refusal_text(err)) from None
    click.echo(f"submitted job {job.job_id}")
    click.echo(f"run dir: {cfg.store.run_dir}")
    click.echo(f"watch:   areal-hpc status {cfg.store.run_dir}")


@click.command("resume")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.argument("overrides", nargs=-1)
@click.option("--sbatch", "via", flag_value="sbatch", help="Render the run's batch script and submit it with sbatch.")
@click.option("--submitit", "via", flag_value="submitit", help="Submit through submitit.")
def resume_cmd(run_dir: str, overrides: tuple[str, ...], via: str | None) -> None:
    """Submit the run in RUN_DIR again from its newest checkpoint, with KEY=VALUE overrides that are safe to change
    (more versions, time, nodes, eval settings); the default is how the run was submitted before."""
    from areal_hpc.launch.local import RunFailed
    from areal_hpc.launch.request_checks import refusal_text
    from areal_hpc.launch.resume import describe_changes, resume
    from areal_hpc.launch.slurm import SlurmError

    try:
        job_id, changes, ckpt = resume(run_dir, list(overrides), via)
    except (SlurmError, RunFailed, ValueError, OSError) as err:
        raise click.ClickException(refusal_text(err)) from None
    start = f"checkpoint v{ckpt}" if ckpt is not None else "the beginning (no complete checkpoint)"
    click.echo(f"submitted job {job_id}: resumes from {start}; {describe_changes(changes)}")
    click.echo(f"watch:   areal-hpc status {Path(run_dir).resolve()}")


@click.command("sweep")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--grid", "grid", multiple=True, required=True, help="KEY=V1,V2,... (repeat for more keys)")
@click.option("--sweep-dir", required=True, type=click.Path(file_okay=False), help="Where the points' run dirs go.")
@click.option("--max-parallel", type=int, default=None, help="At most this many points running at once.")
def sweep_cmd(
    config_path: str, overrides: tuple[str, ...], grid: tuple[str, ...], sweep_dir: str, max_parallel: int | None
) -> None:
    """Submit a grid over CONFIG_PATH [KEY=VALUE ...] as one Slurm job array."""
    import yaml

    from areal_hpc.launch.local import RunFailed
    from areal_hpc.launch.slurm import SlurmError
    from areal_hpc.launch.sweep import sweep

    parsed = {}
    for g in grid:
        if "=" not in g:
            raise click.ClickException(f"--grid {g!r} must look like key=v1,v2 (e.g. rollout.eta=0,4)")
        key, values = g.split("=", 1)
        parsed[key] = [yaml.safe_load(v) for v in values.split(",")]
    try:
        jobs = sweep(config_path, parsed, sweep_dir, list(overrides), max_parallel)
    except (SlurmError, RunFailed, ValueError, OSError) as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    click.echo(f"submitted {len(jobs)} points as job array {jobs[0].job_id.split('_')[0]}")
    click.echo(f"results: areal-hpc collect {sweep_dir}")


@click.command("collect")
@click.argument("sweep_dir", type=click.Path(file_okay=False))
def collect_cmd(sweep_dir: str) -> None:
    """Print a sweep's results (one row per point)."""
    from areal_hpc.launch.slurm import SlurmError
    from areal_hpc.launch.sweep import collect

    try:
        df = collect(sweep_dir)
    except SlurmError as err:
        raise click.ClickException(str(err)) from None
    click.echo(df.drop(columns=["run_dir"]).to_string(index=False))


@click.command("status")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
def status_cmd(run_dir: str) -> None:
    """Slurm state (sacct) and progress (version, reward, throughput) of the run in RUN_DIR."""

    from areal_hpc.launch.slurm import SlurmError, job_state, load_job, pending_reason

    try:
        job = load_job(Path(run_dir))
        state = job_state(job["job_id"])
    except SlurmError as err:
        raise click.ClickException(str(err)) from None
    why = f" ({pending_reason(job['job_id'])})" if state == "PENDING" else ""
    click.echo(f"job {job['job_id']}: {state}{why}")
    from areal_hpc.launch.jobs import other_jobs_lines
    from areal_hpc.launch.progress_view import progress_lines, this_start_began
    from areal_hpc.launch.restarts import error_line, restarts_line

    run, job_id = Path(run_dir), str(job["job_id"])
    for line in other_jobs_lines(run, job_id):  # every other active job of the run
        click.echo(line)
    began = this_start_began(run, job_id, state)  # what began earlier is another start's, not shown as this one's
    if line := restarts_line(run, job_id):  # this job's, not an earlier job's
        click.echo(line)
    if line := error_line(run, job_id, began):  # the latest world's error, or why the job gave up
        click.echo(f"error: {line}")
    # this start's progress only ("starting (resumed from v200)" until it writes its own), never a traceback
    for line in progress_lines(run, state, began):
        click.echo(line)


@click.command("cancel")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
def cancel_cmd(run_dir: str) -> None:
    """Cancel every Slurm job of the run in RUN_DIR (its checkpoints stay: go on with areal-hpc resume RUN_DIR)."""
    from areal_hpc.launch.jobs import cancel_run
    from areal_hpc.launch.slurm import SlurmError

    try:
        ids = cancel_run(Path(run_dir))
    except SlurmError as err:
        raise click.ClickException(str(err)) from None
    click.echo("cancelled " + ", ".join(f"job {j}" for j in ids))


@click.command("prepare", hidden=True)
@click.argument("run_dir", type=click.Path(file_okay=False))
def prepare_cmd(run_dir: str) -> None:
    """(Run by the batch script) make RUN_DIR ready to start or resume."""
    from areal_hpc.launch.slurm import prepare_run_dir
    from areal_hpc.model import ModelFolderError

    try:
        click.echo(f"[areal] {prepare_run_dir(run_dir)}")
    except (ModelFolderError, OSError, ValueError) as err:
        raise click.ClickException(str(err).splitlines()[0]) from None


def disk_line(cfg) -> str:
    """What the run will write (checkpoints kept, rollouts, weights), or why that cannot be said yet."""
    from areal_hpc.disk_estimate import estimate_disk, read_model_shape

    try:
        if read_model_shape(cfg.model.path) is None:
            return f"disk: not estimated (no config.json in model.path={cfg.model.path} yet)"
        return estimate_disk(cfg).describe()
    except (OSError, ValueError) as err:
        return f"disk: not estimated ({str(err).splitlines()[0]})"
