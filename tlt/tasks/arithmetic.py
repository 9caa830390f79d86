"""Multi-step modular arithmetic: a procedurally generated reasoning task with a long tail.

A problem is a start value and a chain of `+b` / `-b` operations, all mod `modulus`:

    prompt    Q:47+8-3+5\\nA:
    solution  47+8=55;55-3=52;52+5=57;#57
    answer    57

Every value is printed zero-padded to the width of `modulus - 1` (two digits for the default 100),
every operand is one digit (1..max_operand). The completion a model writes is the solution text; the
end-of-sequence token follows it and is not part of the text.

Why this task: the number of steps k is drawn from a truncated Zipf law, P(k) ~ k^-zipf_exponent on
1..max_steps, so most solutions are short and a few are an order of magnitude longer. That is the
shape of real RL rollouts (the long tail that keeps a few workers busy while the others idle), at a
size a CPU test can generate in milliseconds. A solution's length is linear in k, so the tail of k is
the tail of rollout lengths.

`ArithmeticTask.solve` writes the reference solution; with `error_rate > 0` it also writes the
deliberately imperfect solutions used for SFT: a faulty step writes a wrong result and later steps
carry on from it, so the final answer is wrong and RL has something to fix.

`verify` is the reward: 1.0 when the text ends in `#<digits>` equal to the answer, `format_weight`
when the text follows the step grammar exactly but the answer is wrong, 0.0 otherwise.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import random
import re
from dataclasses import dataclass
from typing import Sequence

SPLITS = ("train", "eval")
OPS = ("+", "-")
# An injected error moves a value by 1..MAX_ERROR (either sign), so a wrong step looks plausible.
MAX_ERROR = 10

_FINAL_ANSWER = re.compile(r"#([0-9]+)\s*\Z")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TaskConfig:
    """Shape of the arithmetic task.

    max_steps: the longest chain of operations a problem can have.
    zipf_exponent: s in P(k) ~ k^-s over k = 1..max_steps; 1.5 gives a median of 2 steps and a p99
        near 54, so the p99 solution is ~20x the median one.
    modulus: all values are taken mod this; it also fixes the printed width of values.
    max_operand: operands are drawn from 1..max_operand and printed as one digit.
    format_weight: reward for a completion that follows the step grammar but has the wrong answer.
    """

    max_steps: int = 64
    zipf_exponent: float = 1.5
    modulus: int = 100
    max_operand: int = 9
    format_weight: float = 0.0

    def __post_init__(self) -> None:
        if not _is_int(self.max_steps) or self.max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {self.max_steps!r}")
        if (
            not isinstance(self.zipf_exponent, (int, float))
            or isinstance(self.zipf_exponent, bool)
            or not math.isfinite(self.zipf_exponent)
            or self.zipf_exponent < 0
        ):
            raise ValueError(f"zipf_exponent must be a finite number >= 0, got {self.zipf_exponent!r}")
        # With modulus 2 a value has only one wrong alternative, so a second injected error would
        # always undo the first; 3 is the smallest modulus where errors can be kept from cancelling.
        if not _is_int(self.modulus) or self.modulus < 3:
            raise ValueError(f"modulus must be an int >= 3, got {self.modulus!r}")
        if not _is_int(self.max_operand) or not 1 <= self.max_operand <= 9:
            raise ValueError(
                f"max_operand must be an int in 1..9 (operands are printed as one digit), "
                f"got {self.max_operand!r}"
            )
        if (
            not isinstance(self.format_weight, (int, float))
            or isinstance(self.format_weight, bool)
            or not 0.0 <= self.format_weight <= 1.0
        ):
            raise ValueError(f"format_weight must be a number in [0, 1], got {self.format_weight!r}")

    @property
    def width(self) -> int:
        """Digits every value is printed with: those of the largest value, modulus - 1."""
        return len(str(self.modulus - 1))

    @property
    def max_solution_tokens(self) -> int:
        """Characters of the longest reference solution (max_steps steps `aa+b=cc;`, then `#cc`) plus the
        end-of-sequence token: the response budget that truncates no correct solution."""
        return self.max_steps * (2 * self.width + 4) + self.width + 2


@dataclass(frozen=True)
class Problem:
    """One task instance; `solution` is the correct reference solution and ends in `#answer`."""

    prompt: str
    answer: str
    solution: str
    num_steps: int
    start: int
    ops: tuple[tuple[str, int], ...]


def parse_answer(completion: str) -> str | None:
    """The digits after the final '#' when the completion ends in `#<digits>` (trailing whitespace
    allowed), else None."""
    match = _FINAL_ANSWER.search(completion)
    return match.group(1) if match else None


@functools.lru_cache(maxsize=None)
def _step_grammar(width: int) -> re.Pattern[str]:
    value = f"[0-9]{{{width}}}"
    return re.compile(f"({value}[+-][0-9]={value};)*#{value}")


def verify(completion: str, answer: str, format_weight: float = 0.0) -> float:
    """Reward of a completion against the answer string.

    1.0 if the completion ends in `#<digits>` and the digits equal `answer` as integers; otherwise
    `format_weight` if the completion (less trailing whitespace) is exactly a chain of steps
    `aa+b=cc;` followed by `#cc`, values as wide as `answer`; otherwise 0.0. The grammar checks the
    form only, not the arithmetic: partial credit is for writing a solution, not for a right one.
    """
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight!r}")
    if not answer or not answer.isascii() or not answer.isdigit():
        raise ValueError(f"answer must be a non-empty string of digits, got {answer!r}")
    got = parse_answer(completion)
    if got is not None and int(got) == int(answer):
        return 1.0
    if _step_grammar(len(answer)).fullmatch(completion.rstrip()):
        return float(format_weight)
    return 0.0


def _stream_seed(seed: int, split: str) -> int:
    """A generator seed for (seed, split) that is stable across processes and Python versions,
    which the salted built-in hash() is not."""
    digest = hashlib.sha256(f"tlt.tasks.arithmetic:{split}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


class ArithmeticTask:
    """Samples problems, writes (optionally faulty) solutions and scores completions."""

    config_class = TaskConfig

    def __init__(self, config: TaskConfig | None = None) -> None:
        self.config = config if config is not None else TaskConfig()
        self._steps = list(range(1, self.config.max_steps + 1))
        # Cumulative once here, so each draw is a bisect instead of a pass over the weights.
        self._cum_weights = list(itertools.accumulate(k**-self.config.zipf_exponent for k in self._steps))

    def _fmt(self, value: int) -> str:
        return f"{value:0{self.config.width}d}"

    def sample(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        """`n` problems, the same for the same (seed, split); each split is its own random stream."""
        if not _is_int(n) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        rng = random.Random(_stream_seed(seed, split))
        return [self._draw(rng) for _ in range(n)]

    def _draw(self, rng: random.Random) -> Problem:
        (num_steps,) = rng.choices(self._steps, cum_weights=self._cum_weights)
        start = rng.randrange(self.config.modulus)
        ops = tuple((rng.choice(OPS), rng.randint(1, self.config.max_operand)) for _ in range(num_steps))
        return self.problem(start, ops)

    def problem(self, start: int, ops: Sequence[tuple[str, int]]) -> Problem:
        """The problem for a given start value and operations, with its reference solution."""
        solution = self.solve(start, ops)
        answer = solution[solution.rindex("#") + 1 :]
        prompt = "Q:" + self._fmt(start) + "".join(f"{op}{b}" for op, b in ops) + "\nA:"
        return Problem(
            prompt=prompt,
            answer=answer,
            solution=solution,
            num_steps=len(ops),
            start=start,
            ops=tuple((op, b) for op, b in ops),
        )

    def solve(
        self,
        start: int,
        ops: Sequence[tuple[str, int]],
        error_rate: float = 0.0,
        rng: random.Random | None = None,
    ) -> str:
        """The step-by-step solution `aa+b=cc;...#cc`.

        With `error_rate > 0` each step independently, with that probability, writes a result off by
        1..MAX_ERROR (either sign, mod modulus), and the following steps compute from the written
        value. The offset is chosen so the running error never returns to zero, so a solution with
        any faulty step has a wrong final answer. `rng` is required then, to keep runs reproducible.
        """
        m = self.config.modulus
        if not _is_int(start) or not 0 <= start < m:
            raise ValueError(f"start must be an int in 0..{m - 1}, got {start!r}")
        for op, b in ops:
            if op not in OPS or not _is_int(b) or not 1 <= b <= self.config.max_operand:
                raise ValueError(
                    f"each op must be ('+' or '-', 1..{self.config.max_operand}), got {(op, b)!r}"
                )
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate!r}")
        if error_rate > 0 and rng is None:
            raise ValueError("error_rate > 0 needs an explicit rng")

        offsets = [d for d in range(-min(MAX_ERROR, m - 1), min(MAX_ERROR, m - 1) + 1) if d != 0]
        drift = 0  # written value minus true value, mod m
        value = start
        steps = []
        for op, b in ops:
            result = (value + b if op == "+" else value - b) % m
            if error_rate > 0 and rng.random() < error_rate:
                d = rng.choice([d for d in offsets if (drift + d) % m != 0])
                result = (result + d) % m
                drift = (drift + d) % m
            steps.append(f"{self._fmt(value)}{op}{b}={self._fmt(result)};")
            value = result
        return "".join(steps) + "#" + self._fmt(value)

    def reward(self, completion: str, problem: Problem) -> float:
        """`verify` against the problem's answer with this task's format_weight."""
        return verify(completion, problem.answer, self.config.format_weight)
