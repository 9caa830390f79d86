"""Reward functions by name or import path.

Every reward function has TRL's signature, `f(prompts, completions, **columns) -> list[float]`: one
float per completion; `columns` are the dataset's other columns as lists aligned with the prompts.
Built-in functions register under a short name in `REWARDS`; anything else is `module:function`
(`my_rewards:length_penalty`), imported when the run starts so a typo fails before any rollout.
"""

from __future__ import annotations

from typing import Callable, Sequence

from tlt.config import import_callable
from tlt.errors import ConfigError

RewardFn = Callable[..., list[float]]
REWARDS: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return wrap


def get_reward(spec: str | RewardFn) -> RewardFn:
    """A registered name, a `module:function` import path, or a callable (returned as is)."""
    if callable(spec):
        return spec
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise ConfigError(f"unknown reward {spec!r}: expected one of {sorted(REWARDS)} or an import path 'module:function'")
    return import_callable(spec, "reward")


@register("arithmetic")
def arithmetic_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                      format_weight: float = 0.0, **_: object) -> list[float]:
    """The built-in task's verifier: 1 for the right final answer, else 0 (or `format_weight` for a
    well-formed but wrong solution)."""
    from tlt.tasks import verify

    return [verify(c, a, format_weight) for c, a in zip(completions, answer)]
