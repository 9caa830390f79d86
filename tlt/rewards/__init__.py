"""Rewards: a registry of named reward functions and user functions by import path, and a runner
that scores batches in worker processes with timeouts so a bad row costs its reward, not the run."""

from tlt.rewards.math import math_reward  # importing it registers "math"; math-verify loads on first use
from tlt.rewards.registry import REWARDS, RewardFn, get_reward, register
from tlt.rewards.runner import RewardResult, RewardRunner

__all__ = ["REWARDS", "RewardFn", "RewardResult", "RewardRunner", "get_reward", "math_reward", "register"]
