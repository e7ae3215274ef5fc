"""The `areal-hpc` command line: configs, local runs, Slurm render/submit/sweep/status, the reference loop."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from areal_hpc.config import ConfigError, load_config, to_yaml
from areal_hpc.rundir import RunDir


def _load(config_path: str, overrides: tuple[str, ...]):
    try:
        return load_config(config_path, list(overrides))
    except ConfigError as err:
        raise click.ClickException(str(err)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """areal-hpc: fully asynchronous RL for LLM reasoning, on Slurm or one machine."""


@main.command("config")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def config_cmd(config_path: str, overrides: tuple[str, ...]) -> None:
    """Print the resolved config: CONFIG_PATH plus dotted KEY=VALUE overrides."""
    click.echo(to_yaml(_load(config_path, overrides)), nl=False)


@main.command("train-sync")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def train_sync_cmd(config_path: str, overrides: tuple[str, ...]) -> None:
    """Run the single-process synchronous learning loop (generate, reward, store, train)."""
    cfg = _load(config_path, overrides)
    from areal_hpc.model import ModelFolderError
    from areal_hpc.runtime.sync_loop import run_sync

    try:
        s = run_sync(cfg)
    except (ModelFolderError, OSError, ValueError) as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    click.echo(
        f"held-out accuracy: {s.acc_before:.1%} at start, {s.acc_after_warm_start:.1%} after warm start, "
        f"{s.acc_after:.1%} after {s.versions} RL versions ({s.rl_wall_s:.0f} s of RL, {s.wall_s:.0f} s total)"
    )
    click.echo(f"run dir:     {s.run_dir}")
    click.echo(f"metrics:     {RunDir(s.run_dir).metrics}")
    click.echo(f"tensorboard: tensorboard --logdir {s.tensorboard_dir}")


@main.command("run")
@click.argument("config_path", required=False, type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False),
    help="Continue the run in this RUN_DIR from its last checkpoint.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar (for logs and CI).")
def run_cmd(config_path: str | None, overrides: tuple[str, ...], resume_dir: str | None, no_progress: bool) -> None:
    """Run the asynchronous runtime under mpirun: CONFIG_PATH [KEY=VALUE ...], or --resume RUN_DIR [KEY=VALUE ...]."""
    from areal_hpc.launch.local import RunFailed, launch, staleness_histogram
    from areal_hpc.model import ModelFolderError

    if resume_dir:
        if config_path is not None:  # with --resume every argument is an override
            overrides = (config_path, *overrides)
        saved = RunDir(resume_dir).config
        if not saved.is_file():
            raise click.ClickException(f"{resume_dir!r} is not a run dir (no {saved.name})")
        cfg = _load(str(saved), (*overrides, f"store.run_dir={Path(resume_dir).resolve()}"))
    elif config_path is None:
        raise click.ClickException("give a config file (e.g. jobs/demo.yaml) or --resume RUN_DIR")
    else:
        cfg = _load(config_path, overrides)
    if no_progress:
        cfg.logging.progress = False
    try:
        s = launch(cfg, resume=bool(resume_dir), progress=cfg.logging.progress)
    except (RunFailed, ModelFolderError, OSError, ValueError) as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    run_dir = RunDir(Path(cfg.store.run_dir).resolve())
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    click.echo(
        f"versions:    {s['start_version']} -> {s['versions']} ({s['stop_reason']}) "
        f"in {s['rl_wall_s']:.0f} s of RL, {s['wall_s']:.0f} s total"
    )
    click.echo(
        f"held-out:    {pct(s['acc_init'])} at start, {pct(s['acc_start'])} after warm start, "
        f"{pct(s['acc_final'])} at the end"
    )
    click.echo(
        f"throughput:  {s['consumed_tokens_per_s']:.0f} consumed tokens/s "
        f"({s['tokens_consumed']} tokens, {s['samples_consumed']} samples)"
    )
    hist = staleness_histogram(run_dir.root)
    click.echo(
        f"staleness:   {hist} (versions behind -> trajectories); "
        f"dropped too stale: {s['dropped_stale']} groups, {s['dropped_on_resume']} on resume"
    )
    click.echo(
        f"sampling:    {s.get('rejected_uniform', 0)} groups rejected as uniform (all rewards equal) and refilled; "
        f"{s.get('aborted_requests', 0)} requests interrupted for new weights and resumed; "
        f"{s.get('prefill_tokens', 0)} tokens prefilled"
    )
    if s.get("sync_s_mean") is not None:
        # per version: on a small model GB/s only measures how fast the generators reach the collective
        how = f"through {run_dir.weights}" if cfg.sync.method == "disk" else "bucketed broadcast"
        load = f", loaded in {1e3 * s['load_s_mean']:.0f} ms" if s.get("load_s_mean") is not None else ""
        click.echo(
            f"weight sync: {1e3 * s['sync_s_mean']:.0f} ms per version to send {s['sync_bytes'] / 1e6:.1f} MB "
            f"({how}, {s['sync_gbps_mean']:.2f} GB/s){load}; weight_update={s.get('weight_update')}"
        )
    rel = [p.relative_to(run_dir.root) for p in (run_dir.metrics, run_dir.timeline, run_dir.logs, run_dir.checkpoints)]
    click.echo(f"run dir:     {run_dir.root}  ({', '.join(map(str, rel))})")
    if cfg.logging.tensorboard:
        click.echo(f"tensorboard: tensorboard --logdir {run_dir.tensorboard}")


@main.command("render")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--check/--no-check", default=True, help="Check the request against the cluster (sinfo) first.")
def render_cmd(config_path: str, overrides: tuple[str, ...], check: bool) -> None:
    """Print the heterogeneous-job sbatch script for CONFIG_PATH [KEY=VALUE ...] (submit it with sbatch)."""
    from areal_hpc.launch.slurm import SlurmError, check_request, render_sbatch, which_slurm

    cfg = _load(config_path, overrides)
    try:
        if check and which_slurm():
            check_request(cfg)
        script = render_sbatch(cfg, " ".join([config_path, *overrides]))
        # sbatch opens the job's output file in RUN_DIR/logs before the script runs: it must exist
        RunDir(Path(cfg.store.run_dir).resolve()).logs.mkdir(parents=True, exist_ok=True)
    except SlurmError as err:
        raise click.ClickException(str(err)) from None
    click.echo(script, nl=False)


@main.command("submit")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def submit_cmd(config_path: str, overrides: tuple[str, ...]) -> None:
    """Submit CONFIG_PATH [KEY=VALUE ...] as a heterogeneous Slurm job through submitit."""
    from areal_hpc.launch.local import RunFailed
    from areal_hpc.launch.slurm import SlurmError
    from areal_hpc.launch.submit import submit

    cfg = _load(config_path, overrides)
    try:
        job = submit(cfg)
    except (SlurmError, RunFailed, ValueError, OSError) as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    click.echo(f"submitted job {job.job_id}")
    click.echo(f"run dir: {cfg.store.run_dir}")
    click.echo(f"watch:   areal-hpc status {cfg.store.run_dir}")


@main.command("sweep")
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


@main.command("collect")
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


@main.command("report")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option(
    "--baseline", type=click.Path(file_okay=False, exists=True), help="run the ratios are to (default: the first)"
)
@click.option("--target-acc", type=float, help="held-out accuracy whose wall time to reach is compared")
@click.option("-o", "--output", default="report.html", show_default=True, type=click.Path(dir_okay=False))
def report_cmd(run_dirs: tuple[str, ...], baseline: str | None, target_acc: float | None, output: str) -> None:
    """Compare runs (or a sweep's points) in one self-contained HTML file: speedup, curves, staleness, configs."""
    from areal_hpc.analysis.report import write_report
    from areal_hpc.rundir import RunDirError

    try:
        out = write_report(list(run_dirs), output, baseline=baseline, target_acc=target_acc)
    except (RunDirError, ValueError) as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"wrote {out}")


@main.command("simulate")
@click.argument("config_path", required=False, type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option(
    "--calibrate",
    "calibrate_dir",
    type=click.Path(file_okay=False, exists=True),
    help="Fit the cost model and latencies to this finished run (CONFIG is then optional).",
)
@click.option("--sweep", "sweep_spec", help="KEY=V1,V2,... : one simulated run per value, as a table.")
@click.option("--plot", type=click.Path(dir_okay=False), help="With --sweep: write the throughput figure here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the figures as JSON here.")
def simulate_cmd(config_path, overrides, calibrate_dir, sweep_spec, plot, json_path) -> None:
    """Predict a run's throughput, utilisation and staleness in seconds (a discrete-event model of the loop)."""
    import json

    from areal_hpc import simulate as sim_mod

    try:
        if calibrate_dir:
            if config_path is not None and "=" in config_path:
                overrides = (config_path, *overrides)
            sim, measured = sim_mod.calibrate(calibrate_dir, list(overrides))
            click.echo(
                f"calibrated on {calibrate_dir}: {measured['consumed_tokens_per_s']:.0f} consumed tokens/s measured "
                f"up to the last version trained; batches relayed in {measured['batch_latency_s'] * 1e3:.0f} ms"
            )
        elif config_path is None:
            raise click.ClickException("give a config file (e.g. jobs/emulated_1p5b.yaml) or --calibrate RUN_DIR")
        else:
            sim = sim_mod.sim_config(_load(config_path, overrides))
        out: dict = {"cost": sim.cost.to_dict()}
        if sweep_spec:
            key, values = sim_mod.parse_sweep(sweep_spec)
            table = sim_mod.sweep(sim, key, values)
            click.echo(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
            out["sweep"] = table.to_dict(orient="records")
            if plot:
                sim_mod.sweep_figure(table, key).savefig(plot, dpi=120)
                click.echo(f"wrote {plot}")
        else:
            r = sim_mod.simulate(sim)
            row = r.row()
            click.echo(
                f"simulated {r.versions} versions in {r.wall_s:.1f} s: {row['consumed_tokens_per_s']:.0f} consumed "
                f"tokens/s, {row['gen_tokens_per_s']:.0f} generated tokens/s"
            )
            click.echo(f"busy:        generators {r.gen_busy:.1%}, trainers {r.train_busy:.1%}")
            click.echo(
                f"staleness:   {r.staleness} (versions behind -> trajectories); dropped too stale: {r.dropped_stale}"
            )
            out["result"] = row | {"staleness": r.staleness}
    except ValueError as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    if json_path:
        from areal_hpc.utils import atomic_write_text

        atomic_write_text(Path(json_path), json.dumps(out, indent=1, default=float))
        click.echo(f"wrote {json_path}")


@main.command("eval")
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
@click.argument("overrides", nargs=-1)
def eval_cmd(
    model_path, data, config_path, n_samples, temperature, max_new_tokens, engine, json_path, slurm, submit, overrides
):
    """Evaluate RUN_DIR/checkpoints/vN or a Hugging Face folder: pass@1 as avg@k (+- standard error), pass@k."""
    from areal_hpc import checkpoint_eval as ce
    from areal_hpc.model import ModelFolderError

    try:
        target = ce.resolve(model_path, config_path, list(overrides))
        if slurm:
            opts = dict(n_samples=n_samples, temperature=temperature, engine=engine, max_new_tokens=max_new_tokens)
            _eval_job(target, model_path, data, config_path, json_path, submit, overrides, opts)
            return
        try:
            out = ce.run_eval(target, data, n_samples, temperature, max_new_tokens, engine)
        finally:
            target.close()
    except (ConfigError, ModelFolderError, OSError, ValueError) as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    for line in ce.summary_lines(out):
        click.echo(line)
    if json_path:
        ce.write_json(out, json_path)
        click.echo(f"wrote {json_path}")


def _eval_job(target, model_path, data, config_path, json_path, submit, overrides, opts) -> None:
    """`eval --slurm`: the same evaluation as a sbatch script (printed, or submitted with --submit)."""
    from areal_hpc.launch.eval_job import SlurmError, eval_argv, eval_script, submit_eval_sbatch

    argv = eval_argv(model_path, data, config_path, json_path, opts, list(overrides))
    try:
        script = eval_script(target, argv)
        click.echo(f"submitted job {submit_eval_sbatch(script)}" if submit else script, nl=submit)
    except SlurmError as err:
        raise click.ClickException(str(err)) from None


@main.command("status")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
def status_cmd(run_dir: str) -> None:
    """Slurm state (sacct) and progress (version, reward, throughput) of the run in RUN_DIR."""

    from areal_hpc.launch.slurm import SlurmError, job_state, load_job

    try:
        job = load_job(Path(run_dir))
        state = job_state(job["job_id"])
    except SlurmError as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"job {job['job_id']}: {state}")
    from areal_hpc.launch.restarts import restarts_line

    if line := restarts_line(Path(run_dir)):
        click.echo(line)
    if (p := RunDir(run_dir).read_progress()) is None:
        click.echo("progress: none yet (the run has not published its first version)")
        return
    reward = "n/a" if p.get("reward_mean") is None else f"{p['reward_mean']:.3f}"
    acc = "n/a" if p.get("heldout_acc") is None else f"{p['heldout_acc']:.1%}"
    click.echo(
        f"progress: version {p['version']}/{p['versions']} ({p['state']}), reward {reward}, held-out {acc}, "
        f"{p['consumed_tokens_per_s']:.0f} consumed tokens/s, {p['elapsed_s']:.0f} s since start"
    )


@main.command("cancel")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
def cancel_cmd(run_dir: str) -> None:
    """Cancel the Slurm job of the run in RUN_DIR (its checkpoints stay; resume by submitting again)."""
    from areal_hpc.launch.slurm import SlurmError, cancel, load_job

    try:
        job = load_job(Path(run_dir))
        cancel(job["job_id"])
    except SlurmError as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"cancelled job {job['job_id']}")


@main.command("prepare", hidden=True)
@click.argument("run_dir", type=click.Path(file_okay=False))
def prepare_cmd(run_dir: str) -> None:
    """(Run by the batch script) make RUN_DIR ready to start or resume."""
    from areal_hpc.launch.slurm import prepare_run_dir
    from areal_hpc.model import ModelFolderError

    try:
        click.echo(f"[areal] {prepare_run_dir(run_dir)}")
    except (ModelFolderError, OSError, ValueError) as err:
        raise click.ClickException(str(err).splitlines()[0]) from None


if __name__ == "__main__":
    sys.exit(main())
