"""The `areal-hpc` command line: print configs, run the demo loop."""

from __future__ import annotations

import sys

import click

from areal_hpc.config import ConfigError, load_config, to_yaml


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
    click.echo(f"metrics:     {s.run_dir / 'metrics.csv'}")
    click.echo(f"tensorboard: tensorboard --logdir {s.tensorboard_dir}")


if __name__ == "__main__":
    sys.exit(main())
