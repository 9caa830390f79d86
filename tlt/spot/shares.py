"""Shares of a pooled rollout: which worker generates which request groups.

Whole groups (a prompt's n samples share one prefill) are spread over the workers by predicted cost,
largest first onto the least-loaded worker (`assign`). The cost of a group is n x its predicted response
length (`LengthPredictor`): the prompt's own last mean length when it was seen before, else a
least-squares line on prompt length over what was seen, else 1.
"""

from __future__ import annotations

from collections.abc import Sequence


class LengthPredictor:
    """Predicted response length of a prompt (see the module docstring); `observe` after each rollout."""

    def __init__(self) -> None:
        self.by_prompt: dict[tuple[int, ...], float] = {}
        self.points: list[tuple[int, float]] = []  # (prompt length, mean response length), recent ones

    def observe(self, prompt: Sequence[int], lengths: Sequence[int]) -> None:
        mean = sum(lengths) / max(len(lengths), 1)
        self.by_prompt[tuple(prompt)] = mean
        self.points = (self.points + [(len(prompt), mean)])[-4096:]

    def predict(self, prompt: Sequence[int]) -> float:
        seen = self.by_prompt.get(tuple(prompt))
        if seen is not None:
            return max(seen, 1.0)
        if len(self.points) < 8:
            return 1.0
        xs, ys = [p[0] for p in self.points], [p[1] for p in self.points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        return max(my + slope * (len(prompt) - mx), 1.0)


def assign(costs: Sequence[float], workers: int) -> list[list[int]]:
    """Indices of `costs` per worker: largest first onto the least-loaded worker (ties: lowest index)."""
    shares: list[list[int]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        w = min(range(workers), key=lambda w: (load[w], w))
        shares[w].append(i)
        load[w] += costs[i]
    return [sorted(s) for s in shares]
