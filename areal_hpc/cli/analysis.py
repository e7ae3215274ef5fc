"""`areal-hpc report` and `simulate`: compare finished runs, predict one before it runs."""

from __future__ import annotations

from pathlib import Path

import click

from areal_hpc.cli.common import load_or_fail


@click.command("report")
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


@click.command("simulate")
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
@click.option("--prompt-tokens", type=int, help="Tokens per prompt (default: the dataset's mean, or the run's).")
@click.option(
    "--shared-prefix-tokens",
    type=int,
    help="Tokens at the start of each prompt that a group's samples share (an agent's preamble; default: all).",
)
def simulate_cmd(
    config_path, overrides, calibrate_dir, sweep_spec, plot, json_path, prompt_tokens, shared_prefix_tokens
) -> None:
    """Predict a run's throughput, utilisation and staleness in seconds (a discrete-event model of the loop)."""
    import json

    from areal_hpc import simulate

    try:
        if calibrate_dir:
            if config_path is not None and "=" in config_path:
                overrides = (config_path, *overrides)
            sim, measured = simulate.calibrate(calibrate_dir, list(overrides))
            click.echo(
                f"calibrated on {calibrate_dir}: {measured['consumed_tokens_per_s']:.0f} consumed tokens/s measured "
                f"up to the last version trained; batches relayed in {measured['batch_latency_s'] * 1e3:.0f} ms"
            )
        elif config_path is None:
            raise click.ClickException("give a config file (e.g. jobs/emulated_1p5b.yaml) or --calibrate RUN_DIR")
        else:
            sim = simulate.sim_config(load_or_fail(config_path, overrides))
        sim = simulate.with_prompts(sim, prompt_tokens, shared_prefix_tokens)
        out: dict = {"cost": sim.cost.to_dict()}
        if sweep_spec:
            key, values = simulate.parse_sweep(sweep_spec)
            table = simulate.sweep(sim, key, values)
            click.echo(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
            out["sweep"] = table.to_dict(orient="records")
            if plot:
                simulate.sweep_figure(table, key).savefig(plot, dpi=120)
                click.echo(f"wrote {plot}")
        else:
            r = simulate.simulate(sim)
            row = r.row()
            click.echo(
                f"simulated {r.versions} versions in {r.wall_s:.1f} s: {row['consumed_tokens_per_s']:.0f} consumed "
                f"tokens/s, {row['gen_tokens_per_s']:.0f} generated tokens/s"
            )
            click.echo(f"busy:        generators {r.gen_busy:.1%}, trainers {r.train_busy:.1%}")
            click.echo(
                f"GPUs:        {r.gpus} ({sim.n_generators} generators x {sim.devices_per_generator}, "
                f"{sim.n_trainers} trainers): "
                f"{r.consumed_tokens_per_gpu_s:.0f} consumed tokens/s per GPU"
            )
            click.echo(
                f"training:    {r.train_s_per_version:.2f} s per version; computed {r.train_tokens_computed:,} of "
                f"the {r.train_tokens_unshared:,} token positions trained on ({r.prefix_saving:.1%} saved by prefix "
                "sharing)"
            )
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
