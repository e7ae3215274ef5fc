"""Reading a run's YAML file: one line for a file that is missing or not YAML, `base:` recipes that vary another,
and keys of older configs mapped to their new names."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from areal_hpc.config.errors import ConfigError
from areal_hpc.trackers import TENSORBOARD


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


def quote_advice(key: str, value: str) -> str:
    """How to write `value` for `key` as YAML text: YAML reads an unquoted {...} as a mapping, [...] as a list."""
    name = key.rsplit(".", 1)[-1]
    return f'quote it: \'{key}="{value}"\' on a shell command line, {name}: "{value}" in a YAML file'


def text_read_as_yaml(key: str, msg: str, overrides: list[str] | None) -> str | None:
    """One line for a text key whose value YAML read as a mapping or a list (an unquoted template such as
    data.prompt_template={a}+{b}=), else None."""
    if not re.search(r"Cannot convert '(DictConfig|ListConfig)' to string", msg):
        return None
    typed = [ov.split("=", 1)[1] for ov in overrides or [] if ov.split("=", 1)[0] == key]
    value = typed[-1] if typed else "{question} ="
    return (
        f"config {key}: {value if typed else 'its value'} is read as YAML, where an unquoted {{...}} is a mapping "
        f"and [...] a list, not text; {quote_advice(key, value)}"
    )


def map_deprecated_keys(merged: DictConfig, layers: list, n_files: int | None = None) -> None:
    """Keys of older configs become what they meant, each with one line saying so. `layers`: the config
    file's layers, then the overrides (the first `n_files` are the file's; None: all)."""
    _map_renamed(merged, layers)
    _map_interrupt(merged, layers)
    _map_tool_sandbox(merged, layers)
    _map_tensorboard(merged, layers, len(layers) if n_files is None else n_files)


# keys that only moved: old name -> new name, the value unchanged
RENAMED_KEYS = {
    "rollout.workflow": "workflow.fn",
}


def _map_renamed(merged: DictConfig, layers: list) -> None:
    """A key of RENAMED_KEYS set under its old name moves to its new one, with one line saying so; the one
    said last wins where both are set."""
    for old, new in RENAMED_KEYS.items():
        value = OmegaConf.select(merged, old)
        if value is None:
            continue
        said_old = [i for i, x in enumerate(layers) if OmegaConf.select(x, old) is not None]
        said_new = [i for i, x in enumerate(layers) if OmegaConf.select(x, new) is not None]
        if said_new and said_new[-1] == said_old[-1] and OmegaConf.select(merged, new) != value:
            raise ConfigError(f"config {old}={value} (deprecated, = {new}) contradicts {new}; keep only {new}")
        if not said_new or said_new[-1] < said_old[-1]:
            OmegaConf.update(merged, new, value)
        OmegaConf.update(merged, old, None)
        print(f"areal-hpc: config {old}={value} is deprecated; it means {new}={value}", file=sys.stderr)


def _map_tensorboard(merged: DictConfig, layers: list, n_files: int) -> None:
    """logging.tensorboard (before logging.trackers): false drops tensorboard from the trackers, true keeps it."""
    old = merged.logging.tensorboard
    if old is None:
        return
    trackers = [t for t in merged.logging.trackers if t != TENSORBOARD]
    trackers = [TENSORBOARD, *trackers] if old else trackers
    asked = [i for i, x in enumerate(layers) if OmegaConf.select(x, "logging.trackers") is not None]
    said = [i for i, x in enumerate(layers) if OmegaConf.select(x, "logging.tensorboard") is not None]
    if asked and said and said[-1] < n_files <= asked[-1]:
        # only the file has the old key and an override sets trackers (a resume of a run whose config.yaml
        # predates trackers, which the user cannot edit): the override wins
        merged.logging.tensorboard = None
        return
    asked = [OmegaConf.select(layers[i], "logging.trackers") for i in asked]
    if asked and (TENSORBOARD in asked[-1]) != old:
        raise ConfigError(
            f"config logging.tensorboard={str(old).lower()} (deprecated) contradicts logging.trackers="
            f"[{','.join(asked[-1])}]; keep only logging.trackers"
        )
    merged.logging.trackers, merged.logging.tensorboard = trackers, None
    print(
        f"areal-hpc: config logging.tensorboard={str(old).lower()} is deprecated; it means "
        f"logging.trackers=[{','.join(trackers)}]",
        file=sys.stderr,
    )


def _map_interrupt(merged: DictConfig, layers: list) -> None:
    """rollout.interrupt (before rollout.weight_update existed) becomes the mode it meant."""
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


# the sandbox keys of a workflow's tool calls, and the code reward's they read before they had their own
TOOL_SANDBOX_KEYS = {"workflow.tool_sandbox": "reward.sandbox", "workflow.tool_memory_mb": "reward.code_memory_mb"}


def _map_tool_sandbox(merged: DictConfig, layers: list) -> None:
    """reward.sandbox and reward.code_memory_mb, which tool calls (the `tool` workflow's, a workflow of your own's
    ep.run_python) read before workflow.tool_sandbox and workflow.tool_memory_mb, still reach them where the new
    keys are not set, each with one line saying so."""
    if merged.workflow.fn in ("single_turn", "multi_turn", "agent"):  # no tool calls
        return
    for new, old in TOOL_SANDBOX_KEYS.items():
        if any(OmegaConf.select(x, new) is not None for x in layers):
            continue
        value = [v for v in (OmegaConf.select(x, old) for x in layers) if v is not None]
        if value:
            OmegaConf.update(merged, new, value[-1])
            print(
                f"areal-hpc: config {old}={value[-1]} for tool calls is deprecated; it means {new}={value[-1]}",
                file=sys.stderr,
            )
