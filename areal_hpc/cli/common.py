"""What every command shares: a config loaded from CONFIG_PATH plus KEY=VALUE overrides, or one line on error."""

from __future__ import annotations

import click

from areal_hpc.config import ConfigError, load_config


def load_or_fail(config_path: str, overrides: tuple[str, ...] | list[str]):
    try:
        return load_config(config_path, list(overrides))
    except ConfigError as err:
        raise click.ClickException(str(err)) from None
