"""Rewards for rollouts: math (math.py), code in a sandbox (code.py, sandbox.py), scored in a process pool (pool.py)."""

from areal_hpc.reward.code import code_reward, reward_pool_for
from areal_hpc.reward.math import extract_last_boxed, math_reward
from areal_hpc.reward.pool import RewardPool
from areal_hpc.reward.sandbox import SandboxUnavailable, isolation

__all__ = [
    "math_reward",
    "code_reward",
    "RewardPool",
    "reward_pool_for",
    "extract_last_boxed",
    "isolation",
    "SandboxUnavailable",
]
