"""Reading a run's YAML file: one line for a file that is missing or not YAML, `base:` recipes that vary another,
and keys of older configs mapped to their new names."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from areal_hpc.config_checks import ConfigError


def read_config_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> list[DictConfig]:
    """The file's layers, lowest first: its `base:` file's (a path relative to this file, itself possibly
    with a base), then its own keys, so a variant recipe holds only what it changes."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    if p.resolve() in _seen:
        raise ConfigError(f"config file {str(p)!r} is its own base (base: files form a loop)")
    try:
        loaded = OmegaConf.load(p)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {str(p)!r}{where} is not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections (model:, rollout:, ...)")
    base = loaded.pop("base", None)
    if base is None:
        return [loaded]
    if not isinstance(base, str):
        raise ConfigError(f"config file {str(p)!r}: base must be the path of another config file, got {base!r}")
    return [*read_config_file(p.parent / base, (*_seen, p.resolve())), loaded]


def map_deprecated_keys(merged: DictConfig, layers: list) -> None:
    """rollout.interrupt (before rollout.weight_update existed) becomes the mode it meant, with one line saying so."""
    old = merged.rollout.interrupt
    if old is None:
        return
    mode = "recompute" if old else "drain"
    asked = [v for v in (OmegaConf.select(x, "rollout.weight_update") for x in layers) if v is not None]
    if asked and asked[-1] != mode:
        raise ConfigError(
            f"config rollout.interrupt={str(old).lower()} (deprecated, = rollout.weight_update={mode}) contradicts "
            f"rollout.weight_update={asked[-1]}; keep only rollout.weight_update"
        )
    merged.rollout.weight_update, merged.rollout.interrupt = mode, None
    print(
        f"areal-hpc: config rollout.interrupt={str(old).lower()} is deprecated; it means rollout.weight_update={mode}",
        file=sys.stderr,
    )
