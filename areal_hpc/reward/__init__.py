"""Rewards as f(completion, row) -> float (functions.py): math, code in a sandbox, or yours, in a process pool."""

from areal_hpc.reward.code import code_reward
from areal_hpc.reward.functions import BUILTIN_REWARDS, check_reward_fn, reward_fn_names, reward_pool_for
from areal_hpc.reward.math import extract_last_boxed, math_reward
from areal_hpc.reward.pool import RewardPool, Scores
from areal_hpc.reward.sandbox import SandboxUnavailable, isolation

__all__ = [
    "math_reward",
    "code_reward",
    "RewardPool",
    "reward_pool_for",
    "check_reward_fn",
    "reward_fn_names",
    "BUILTIN_REWARDS",
    "Scores",
    "extract_last_boxed",
    "isolation",
    "SandboxUnavailable",
]
