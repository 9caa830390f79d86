"""Reward functions for tests: ones that misbehave on request (the reward runner's tests) and simple
user rewards that read extra dataset columns (the trainer's tests).

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


def scaled_words(prompts, completions, scale=None, **_):
    """`scale` (an extra dataset column) times the completion's word count; a row without the column
    scores 0, so a run whose rewards are all 0 never saw the column."""
    scales = scale if scale is not None else [None] * len(completions)
    return [0.0 if s is None else float(s) * len(c.split()) for c, s in zip(completions, scales)]


def shortest_first(entries):
    """A drafter-buffer sampling policy for tests: weight 1 / length (the opposite of the default)."""
    return [1.0 / max(e.pairs, 1) for e in entries]


def weighted_answer(prompts, completions, answer, weight, **_):
    """`weight` (a required dataset column) where the completion holds `answer`, else 0."""
    return [w * float(a in c) for c, a, w in zip(completions, answer, weight)]


def answer_only(prompts, completions, answer):
    """1.0 where the completion holds `answer`; no **kwargs, so any other column fails the call."""
    return [float(a in c) for c, a in zip(completions, answer)]
