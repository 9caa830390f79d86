"""Reward functions that misbehave on request, for the reward runner's tests.

They live in a module of their own, not in a test file, so worker processes can import them by the
spec "reward_fixtures:name": pytest puts tests/ on sys.path, and spawned workers inherit sys.path.
"""

from __future__ import annotations

import time


def by_completion(prompts, completions, target=None, **_):
    """1.0 where the completion equals the `target` column, else 0.0; a completion "raise" raises,
    "hang" never returns, "nan" scores NaN, and "drop" makes the call return one value too few."""
    rewards = []
    for i, completion in enumerate(completions):
        if completion == "raise":
            raise ValueError(f"cannot score {completion!r}")
        if completion == "hang":
            time.sleep(3600)
        if completion == "nan":
            rewards.append(float("nan"))
        else:
            rewards.append(float(target is not None and completion == target[i]))
    return rewards[:-1] if "drop" in completions else rewards


def one_too_many(prompts, completions, **_):
    return [1.0] * (len(completions) + 1)


def digit_fraction(prompts, completions, **_):
    """The fraction of a completion's characters that are digits: a dense signal a random model varies on."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def poisoned(prompts, completions, **_):
    """NaN for every completion: a reward bug the trainer must catch before it reaches the weights."""
    return [float("nan")] * len(completions)
