"""Checks on what a user brings to a run (config/task.py): the reward functions, the workflow and its agent, the
warm start's template; each fails with one line that names the key."""

from __future__ import annotations

import math
from typing import Any

from areal_hpc.config.errors import ConfigError
from areal_hpc.data.prompts import template_fields
from areal_hpc.plugins import PluginError, is_import_path, split_spec

BUILTIN_WORKFLOWS = ("single_turn", "multi_turn", "tool", "agent")  # workflow.fn by name (areal_hpc.workflow)


def _check_agent(cfg) -> None:
    """The agent settings' form (importing the agent waits for start-up, as reward.fn's does)."""
    workflow_cfg = cfg.workflow
    if cfg.workflow.fn != "agent":
        if workflow_cfg.agent or workflow_cfg.agent_command:
            raise ConfigError(
                f"config workflow.agent / workflow.agent_command name an agent, but workflow.fn="
                f"{cfg.workflow.fn!r}; set workflow.fn=agent"
            )
        return
    if bool(workflow_cfg.agent) == bool(workflow_cfg.agent_command):
        raise ConfigError(
            "config workflow.fn=agent needs exactly one of workflow.agent (path/to/file.py:fn or "
            "package.module:fn) and workflow.agent_command (a command run per episode)"
            + ("; both are set" if workflow_cfg.agent else "")
        )
    if workflow_cfg.agent and not is_import_path(workflow_cfg.agent):
        raise ConfigError(
            f"config workflow.agent={workflow_cfg.agent!r} is not an import path ('package.module:function' or "
            "'path/to/file.py:function')"
        )
    if workflow_cfg.agent:
        _check_plugin(workflow_cfg.agent, "workflow.agent", ())
    if not workflow_cfg.endpoint_host.strip():
        raise ConfigError("config workflow.endpoint_host is empty; 127.0.0.1 (the default) serves this node only")


def _check_plugin(value: str, key: str, builtins: tuple[str, ...]) -> None:
    """A built-in's name or an import path's form (importing it waits for start-up: the launcher and each rank)."""
    if is_import_path(value):
        try:
            split_spec(value, key)
        except PluginError as e:
            raise ConfigError(f"config {e}") from None
    elif value not in builtins:
        named = ", ".join(b for b in builtins if b)
        raise ConfigError(
            f"config {key}={value!r} is neither a built-in ({named}) nor an import path "
            "('package.module:function' or 'path/to/file.py:function')"
        )


def _check_reward(rc) -> None:
    """reward.fn (a name or a list of them), reward.weights (only with a list) and reward.args."""
    if isinstance(rc.fn, str):
        _check_plugin(rc.fn, "reward.fn", ("", "math", "code"))
        if rc.weights:
            raise ConfigError(
                f"config reward.weights={rc.weights!r} needs reward.fn as a list (one weight per function)"
            )
    elif not isinstance(rc.fn, list) or not rc.fn:
        raise ConfigError(f"config reward.fn={rc.fn!r} must be a function (built-in or import path) or a list of them")
    else:
        for i, f in enumerate(rc.fn):
            if not isinstance(f, str) or not f:
                raise ConfigError(f"config reward.fn[{i}]={f!r} must be a built-in (math, code) or an import path")
            _check_plugin(f, f"reward.fn[{i}]", ("math", "code"))
        names = rc.names()
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ConfigError(f"config reward.fn lists two functions named {twice!r}; each is logged as reward/<name>")
        if not isinstance(rc.weights, list):
            raise ConfigError(f"config reward.weights={rc.weights!r} must be a list of numbers, one per reward.fn")
        if rc.weights and len(rc.weights) != len(rc.fn):
            raise ConfigError(
                f"config reward.weights lists {len(rc.weights)} weights but reward.fn lists {len(rc.fn)} functions; "
                "give one weight per function (or none: all 1.0)"
            )
        for i, w in enumerate(rc.weights):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise ConfigError(f"config reward.weights[{i}]={w!r} must be a finite number")
    if rc.args and not any(is_import_path(f) for f in rc.fns()):
        raise ConfigError("config reward.args reaches reward functions of your own; the built-ins take none")


def _check_warm_start(cfg: Any) -> None:
    """trainer.warm_start_template names a field; a code task's warm start needs one naming a solution."""
    trainer_cfg = cfg.trainer
    fields = template_fields(trainer_cfg.warm_start_template)
    if trainer_cfg.warm_start_template and not fields:
        raise ConfigError(
            f"config trainer.warm_start_template={trainer_cfg.warm_start_template!r} must name a row field such as "
            "{answer} ({{ and }} are literal braces)"
        )
    if cfg.data.kind != "code" or not trainer_cfg.warm_start_steps:
        return
    if not trainer_cfg.warm_start_template:
        # the warm start imitates a reference, and a code task's reference is its tests: no answer to imitate
        raise ConfigError(
            "config trainer.warm_start_steps must be 0 with data.kind=code unless trainer.warm_start_template names "
            "a solution field of your rows (the tests are no answer to imitate)"
        )
    if "answer" in fields:
        raise ConfigError(
            f"config trainer.warm_start_template={trainer_cfg.warm_start_template!r} names {{answer}}, which with "
            "data.kind=code is the row's tests (data.answer_key), not a solution; name a solution field of your rows"
        )


def check_task(cfg: Any) -> None:
    """The reward, the workflow and its settings, the warm start's template (the config is taken untyped: it
    imports this module)."""
    _check_warm_start(cfg)
    _check_reward(cfg.reward)
    _check_plugin(cfg.workflow.fn, "workflow.fn", BUILTIN_WORKFLOWS)
    _check_agent(cfg)
    workflow_cfg = cfg.workflow
    if not 0 <= workflow_cfg.warm_start_tool_share <= 1:
        raise ConfigError(
            f"config workflow.warm_start_tool_share={workflow_cfg.warm_start_tool_share!r} must be in [0, 1]"
        )
    if workflow_cfg.turn_discount > 1:
        raise ConfigError(f"config workflow.turn_discount={workflow_cfg.turn_discount!r} must be in [0, 1]")
    if not 0 < workflow_cfg.max_failure_share <= 1:
        raise ConfigError(f"config workflow.max_failure_share={workflow_cfg.max_failure_share!r} must be in (0, 1]")
