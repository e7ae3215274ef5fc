"""Episodes as code a user writes: `async def workflow(ep: Episode) -> float | None`, run many at once by a runner."""

from __future__ import annotations

from areal_hpc.plugins import PluginError, check_signature, resolve
from areal_hpc.workflow.builtin import BUILTIN, WITH_THEIR_FEATURE, multi_turn, single_turn, tool
from areal_hpc.workflow.episode import Episode
from areal_hpc.workflow.failures import EpisodeFailed, FailureBudget, TooManyFailures
from areal_hpc.workflow.records import Completion, EpisodeFailure, Segment, ToolResult
from areal_hpc.workflow.runner import EpisodeRunner, FinishedEpisode, RunnerSettings, Workflow

__all__ = [
    "Episode",
    "Completion",
    "Segment",
    "ToolResult",
    "EpisodeRunner",
    "FinishedEpisode",
    "RunnerSettings",
    "Workflow",
    "EpisodeFailure",
    "EpisodeFailed",
    "FailureBudget",
    "TooManyFailures",
    "load_workflow",
    "check_user_code",
    "runner_settings",
    "single_turn",
    "multi_turn",
    "tool",
]


def load_workflow(name: str) -> Workflow:
    """workflow.fn: a built-in by name, or an `async def f(episode)` by import path (one line if unusable)."""
    if name in BUILTIN:
        return BUILTIN[name]
    if name in WITH_THEIR_FEATURE:
        return resolve(WITH_THEIR_FEATURE[name][0], "workflow.fn")
    fn = resolve(name, "workflow.fn")
    check_signature(fn, name, "workflow.fn", ("episode",), is_async=True)
    return fn


def runner_settings(cfg, tokenizer, model_dir) -> RunnerSettings:
    """What an EpisodeRunner needs from a run's config and model folder."""
    from areal_hpc.data.prompts import chat_enabled, max_context

    return RunnerSettings(
        workflow=cfg.workflow,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_context=max_context(model_dir) if cfg.rollout.engine != "emulated" else None,
        chat=chat_enabled(tokenizer, cfg.data.chat_template, cfg.data.system_prompt),
        tool_memory_mb=cfg.workflow.tool_memory_mb,
        sandbox=cfg.workflow.tool_sandbox,
        config=cfg,
    )


def check_user_code(cfg) -> None:
    """Import reward.fn and workflow.fn and check their signatures: one line (PluginError) if either is
    unusable. Every rank runs it at start-up, before any engine loads, as do the launchers."""
    from areal_hpc.reward import check_reward_fn

    check_reward_fn(cfg)
    load_workflow(cfg.workflow.fn)
    if cfg.workflow.fn in WITH_THEIR_FEATURE:
        check_settings = resolve(WITH_THEIR_FEATURE[cfg.workflow.fn][1], "workflow.fn")
        try:
            check_settings(cfg.workflow)
        except ValueError as e:
            raise PluginError(str(e)) from None
