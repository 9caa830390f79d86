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


def check_columns(fn: RewardFn, name: str, columns: set[str], where: str) -> None:
    """Refuse, before any rollout, a reward that no call with these `columns` could run: a parameter
    without a default that is not a column (a required keyword), or, for a function without
    `**kwargs`, a column it has no parameter for (every column is passed by keyword). Either would
    fail every row from the first step. `where` names the rows' file or task in the error."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature to read (a builtin): nothing to check
        return
    try:
        signature.bind(None, None, **dict.fromkeys(columns))
        return
    except TypeError as exc:
        problem = str(exc)
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    named = [p for p in params if p not in positional and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    shown = sorted(columns)
    missing = [p.name for p in named if p.default is p.empty and p.name not in columns]
    if missing:
        raise ConfigError(f"reward {name!r} needs the column(s) {missing} (parameters without a default), which "
                          f"no row of {where} has; its columns are {shown}: add the column, or give the "
                          "parameter a default")
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        extra = sorted(columns - {p.name for p in named})
        if extra:
            raise ConfigError(f"reward {name!r} has no parameter for the column(s) {extra} of {where}, and every "
                              f"column is passed by keyword; add **kwargs to its signature (TRL's: "
                              "f(prompts, completions, **kwargs))")
    raise ConfigError(f"reward {name!r} cannot be called as f(prompts, completions, **columns) with the columns "
                      f"{shown} of {where} ({problem})")


@register("arithmetic")
def arithmetic_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                      format_weight: float = 0.0, **_: object) -> list[float]:
    """The built-in task's verifier: 1 for the right final answer, else 0 (or `format_weight` for a
    well-formed but wrong solution)."""
    from tlt.tasks import verify

    return [verify(c, a, format_weight) for c, a in zip(completions, answer)]
