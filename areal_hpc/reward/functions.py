"""The reward function of a run, `f(completion, row) -> float`: built-in (math, code) or the user's by import path."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from areal_hpc.data import final_answer
from areal_hpc.plugins import check_signature, resolve
from areal_hpc.reward.code import _score as _code_score
from areal_hpc.reward.emulated import EmulatedRewards
from areal_hpc.reward.math import _math_reward_unbounded
from areal_hpc.reward.pool import RewardPool
from areal_hpc.reward.sandbox import Limits, isolation

__all__ = ["BUILTIN_REWARDS", "reward_fn_name", "check_reward_fn", "reward_pool_for"]

logger = logging.getLogger(__name__)

BUILTIN_REWARDS = ("math", "code")
# A worker waits this much longer than the sandbox's wall timeout: bwrap and python3 start in ~0.1 s.
SANDBOX_SLACK_S = 5.0


def _reference(ref, key: str) -> str:
    """The reference a built-in compares against: the row's `key` field, or `ref` itself when given as text."""
    return ref if isinstance(ref, str) else (ref.get(key) if isinstance(ref, dict) else None)


@dataclass(frozen=True)
class MathAnswer:
    """Built-in `math`: 1.0 when the completion's final answer (its last \\boxed{}) equals the row's `key`
    field (the text after '####' when there is one) under math-verify, else 0.0."""

    key: str = "answer"

    def __call__(self, completion: str, row) -> float:
        return _math_reward_unbounded(completion, final_answer(_reference(row, self.key)) or "")


@dataclass(frozen=True)
class CodeTests:
    """Built-in `code`: 1.0 when the completion's last ```python block passes the row's `key` field (Python
    asserts, a string or a list) in the sandbox, else 0.0."""

    how: str  # bwrap | rlimits-only, resolved once by isolation() in the process that builds the pool
    limits: Limits
    key: str = "tests"

    def __call__(self, completion: str, row) -> float:
        tests = _reference(row, self.key)
        if isinstance(tests, list) and all(isinstance(t, str) for t in tests):
            tests = "\n".join(tests)
        return _code_score(completion, tests, self.how, self.limits)


@dataclass(frozen=True)
class UserReward:
    """`reward.fn` given as an import path: imported by name in each worker process (functions defined in a
    file outside any package cannot be pickled by reference, their path can)."""

    spec: str

    def __call__(self, completion: str, row) -> float:
        return resolve(self.spec, "reward.fn")(completion, row)

    def load(self) -> None:
        """Import the function now (a worker's start-up), not inside the first call's time limit."""
        resolve(self.spec, "reward.fn")


def reward_fn_name(cfg) -> str:
    """reward.fn, or the built-in the dataset implies (code for data.kind=code, else math)."""
    return cfg.reward.fn or ("code" if cfg.data.kind == "code" else "math")


def check_reward_fn(cfg) -> None:
    """Import reward.fn and check it can be called as f(completion, row): one line (PluginError) if not."""
    name = reward_fn_name(cfg)
    if name not in BUILTIN_REWARDS:
        check_signature(resolve(name, "reward.fn"), name, "reward.fn", ("completion", "row"), is_async=False)


def reward_pool_for(cfg, cpus: frozenset[int] | None = None) -> RewardPool | EmulatedRewards:
    """The reward pool a run's config asks for: the reward function in supervised worker processes, or the
    emulated rewards of an emulated engine (its placeholder answers cannot be right). Its worker processes
    run on `cpus` (None: where this process runs).

    For code the isolation is checked here, at start-up: the run stops with one line (SandboxUnavailable)
    when reward.sandbox asks for isolation this machine cannot give.
    """
    rc = cfg.reward
    if cfg.rollout.engine == "emulated":
        return EmulatedRewards(cfg.emulation.p_correct, cfg.trainer.seed)
    name = reward_fn_name(cfg)
    if name == "math":
        return RewardPool(rc.num_workers, rc.timeout_s, MathAnswer(cfg.data.answer_key), cpus=cpus)
    if name == "code":
        iso = isolation(rc.sandbox)
        log = logger.warning if iso.name != "bwrap" else logger.info
        log("code reward isolation: %s (%s)", iso.name, iso.description)
        scorer = CodeTests(iso.name, Limits(wall_s=rc.timeout_s, memory_mb=rc.code_memory_mb), cfg.data.answer_key)
        return RewardPool(rc.num_workers, rc.timeout_s + SANDBOX_SLACK_S, scorer, cpus=cpus)
    check_reward_fn(cfg)
    return RewardPool(rc.num_workers, rc.timeout_s, UserReward(name), cpus=cpus)
