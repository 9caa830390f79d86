r"""The "math" reward: is the completion's final answer equivalent to the reference, as math-verify
judges it (boxed answers, LaTeX, fractions against decimals, sets and intervals)?

The reference comes from whichever column the dataset has: `ground_truth` (verl's layout), `answer`
or `solution` (common in TRL datasets). A bare reference such as `\frac{1}{2}` or `(1, 2)` is read
as LaTeX math (wrapped in `$...$`): math-verify's plain-expression reader would take `(1, 2)` for
the number 2. A reference that already carries `$` or `\boxed` (a written-out solution) is parsed
as it is. An unreadable reference raises, so the runner reports that row instead of scoring it 0
unseen; an unreadable completion simply scores 0.

math-verify (and the sympy behind it) takes about a second to import, so it is imported on the first
call, not with `tlt`. Its own time limits use SIGALRM, which only the main thread may set; off the
main thread they are turned off and the runner's worker timeout is the guard.
"""

from __future__ import annotations

import threading
from typing import Sequence

from tlt.errors import ConfigError
from tlt.rewards.registry import register

_PARSE_TIMEOUT_S = 5  # math-verify's own limit per parse or comparison, where it can set one


@register("math")
def math_reward(prompts: Sequence, completions: Sequence, ground_truth: Sequence | None = None,
                answer: Sequence | None = None, solution: Sequence | None = None, **columns: object) -> list[float]:
    """1.0 per completion whose answer equals the reference (`ground_truth`, `answer` or `solution`,
    the first given), else 0.0."""
    from math_verify import parse, verify

    references = next((c for c in (ground_truth, answer, solution) if c is not None), None)
    if references is None:
        raise ConfigError("reward 'math' needs the reference answer in a column named 'ground_truth', "
                          f"'answer' or 'solution'; the columns given are {sorted(columns)}")
    limit = _PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    rewards = []
    for completion, reference in zip(completions, references, strict=True):
        gold = parse(_as_latex(reference), parsing_timeout=limit)
        if not gold:
            raise ValueError(f"reward 'math': cannot read the reference answer {reference!r}")
        predicted = parse(_text(completion), parsing_timeout=limit)
        rewards.append(float(bool(predicted) and verify(gold, predicted, timeout_seconds=limit)))
    return rewards


def _as_latex(reference: object) -> str:
    text = str(reference).strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def _text(completion: object) -> str:
    """A completion as text; a conversational completion (a list of messages) by its last message."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return str(completion)
