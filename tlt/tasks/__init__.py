"""Built-in reasoning tasks: problems to roll out, reference solutions to SFT on, and rewards.

A task turns a seed into problems (`sample`), writes step-by-step solutions (`solve`, optionally
with injected errors, for an imperfect SFT starting point that RL can improve) and scores a
completion (`reward`, through a pure verifier). The built-in one, multi-step modular arithmetic, is
made for testing an RL system on a CPU: problems are generated, never downloaded; the answer is
checked exactly; and the number of steps follows a Zipf law, so rollout lengths have the long tail
that speculative decoding and the spot trainer exist to exploit. `CharTokenizer` covers its
alphabet with the same interface as a Hugging Face tokenizer, so tiny test models and real
checkpoints go through the same code.

Tasks are looked up by name in `TASKS`; `get_task("arithmetic", max_steps=16)` builds one from its
config fields. `NAMED_TASKS` are fixed configurations of a registered task under their own name:
`bench` is the reasoning-length workload of the bench policy (chains of up to 192 steps, a heavier
tail than the default's: median 7 steps, p90 90, p99 178, so the longest responses run to ~1.5 k
tokens), usable wherever a task name is (`task=bench`, `tlt eval --task bench`).
"""

from __future__ import annotations

import dataclasses

from tlt.tasks.arithmetic import ArithmeticTask, Problem, TaskConfig, parse_answer, verify
from tlt.tasks.tokenizer import CharTokenizer

TASKS = {"arithmetic": ArithmeticTask}
# name -> (registered task, its config fields)
NAMED_TASKS: dict[str, tuple[str, dict[str, object]]] = {
    "bench": ("arithmetic", {"max_steps": 192, "zipf_exponent": 1.1}),
}


def task_names() -> list[str]:
    return sorted([*TASKS, *NAMED_TASKS])


def get_task(name: str, **config_kwargs: object) -> ArithmeticTask:
    """The task registered as `name`, or the named configuration `name` (`NAMED_TASKS`), built from its
    config class with `config_kwargs` (over a named configuration's fields)."""
    if name in NAMED_TASKS:
        base, fields = NAMED_TASKS[name]
        return get_task(base, **{**fields, **config_kwargs})
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {task_names()}")
    task_class = TASKS[name]
    config_class = task_class.config_class
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(config_kwargs) - known)
    if unknown:
        raise ValueError(f"unknown config keys for task {name!r}: {unknown}; known keys: {sorted(known)}")
    return task_class(config_class(**config_kwargs))


__all__ = [
    "NAMED_TASKS",
    "TASKS",
    "ArithmeticTask",
    "CharTokenizer",
    "Problem",
    "TaskConfig",
    "get_task",
    "parse_answer",
    "task_names",
    "verify",
]
