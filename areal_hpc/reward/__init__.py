"""Rewards for rollouts: one reward function per module (math.py), scored in a supervised process pool (pool.py)."""

from areal_hpc.reward.math import extract_last_boxed, math_reward
from areal_hpc.reward.pool import RewardPool

__all__ = ["math_reward", "RewardPool", "extract_last_boxed"]
