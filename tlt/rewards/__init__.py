"""Rewards: a registry of named reward functions and user functions by import path."""

from tlt.rewards.registry import REWARDS, RewardFn, get_reward, register

__all__ = ["REWARDS", "RewardFn", "get_reward", "register"]
