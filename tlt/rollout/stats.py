"""What a rollout measured: `RolloutStats`, one typed record per engine (or per rollout spread over workers).

Counts add, per-step lists run in step order, and the wall time is the rollout's. A rollout split over
workers is one record again by `RolloutStats.merge`: counts add, per-step lists concatenate (worker after
worker), the wall time is the slowest worker's. Rates (tokens per second, mean step time, acceptance
length) are never stored, only derived, so a merged record cannot carry a stale one. The dict form
(`as_dict`, read back by `from_dict`) is the record at the JSON edges: metrics and benchmark files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RolloutStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    step_times: list[float] = field(default_factory=list)  # each decode step's seconds, with the prefill it ran first
    batch_sizes: list[int] = field(default_factory=list)
    strategies: list[str] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # tokens emitted by each decode step
    wall_time: float = 0.0
    sources: dict[str, list[int]] = field(default_factory=dict)  # summed DecodeResult.sources
    step_drafted: list[int] = field(default_factory=list)  # draft tokens each decode step verified (the cost side)

    def __post_init__(self) -> None:
        # a record given without draft counts (a stats JSON that holds none) counts none for its steps
        self.step_drafted = list(self.step_drafted) + [0] * (len(self.step_tokens) - len(self.step_drafted))

    def record_step(self, batch_size: int, strategy: str, tokens: int, sources: dict | None, drafted: int = 0) -> None:
        """One decode step: its live rows, strategy, emitted tokens, per-source draft counts and the draft
        tokens its verification held."""
        self.batch_sizes.append(batch_size)
        self.strategies.append(strategy)
        self.step_tokens.append(tokens)
        self.step_drafted.append(drafted)
        add_sources(self.sources, sources or {})

    @classmethod
    def merge(cls, parts: list["RolloutStats"]) -> "RolloutStats":
        """One record for a rollout spread over workers (see the module docstring)."""
        out = cls(steps=sum(p.steps for p in parts), prefill_tokens=sum(p.prefill_tokens for p in parts),
                  decode_tokens=sum(p.decode_tokens for p in parts),
                  wall_time=max((p.wall_time for p in parts), default=0.0))
        for p in parts:
            out.step_times += p.step_times
            out.batch_sizes += p.batch_sizes
            out.strategies += p.strategies
            out.step_tokens += p.step_tokens
            out.step_drafted += p.step_drafted
            add_sources(out.sources, p.sources)
        return out

    def acceptance_length(self, counted: Callable[[str], bool] = lambda strategy: strategy != "off") -> float | None:
        """Tokens emitted per row per step (accepted drafts + 1) over the steps whose strategy `counted`
        accepts (by default every speculative step); None when there is none."""
        tokens = rows = 0
        for t, b, s in zip(self.step_tokens, self.batch_sizes, self.strategies):
            if counted(s):
                tokens, rows = tokens + t, rows + b
        return tokens / rows if rows else None

    def summed_by_strategy(self, values: list[int]) -> dict[str, int]:
        """A per-step list (`batch_sizes`, `step_tokens`, `step_drafted`) summed over the steps of each
        speculative strategy that ran."""
        sums: dict[str, int] = {}
        for v, s in zip(values, self.strategies):
            if s != "off":
                sums[s] = sums.get(s, 0) + v
        return dict(sorted(sums.items()))

    def rows_by_strategy(self) -> dict[str, int]:
        """Row-steps (live rows x steps) each speculative strategy ran for."""
        return self.summed_by_strategy(self.batch_sizes)

    def drafted_per_row_step(self) -> dict[str, float]:
        """Draft tokens verified per row per step of each speculative strategy that ran: what a step's
        acceptance costs in verified tokens."""
        return self._per_row_step(self.step_drafted)

    def acceptance_by_strategy(self) -> dict[str, float]:
        """Tokens per row per step of each speculative strategy that ran."""
        return self._per_row_step(self.step_tokens)

    def _per_row_step(self, values: list[int]) -> dict[str, float]:
        sums = self.summed_by_strategy(values)
        return {s: sums[s] / rows for s, rows in self.rows_by_strategy().items()}

    def as_dict(self) -> dict:
        n = max(len(self.step_times), 1)
        return {
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "wall_time_s": self.wall_time,
            "mean_step_time_s": sum(self.step_times) / n,
            "tokens_per_s": self.decode_tokens / self.wall_time if self.wall_time else 0.0,
            "step_times_s": list(self.step_times),
            "batch_sizes": list(self.batch_sizes),
            "strategies": list(self.strategies),
            "step_tokens": list(self.step_tokens),
            "step_drafted": list(self.step_drafted),
            "acceptance_length": self.acceptance_length(),
            "draft_sources": {k: list(v) for k, v in self.sources.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "RolloutStats":
        """The record `as_dict` wrote (derived rates and keys it does not know are ignored; draft_sources
        and step_drafted may be missing)."""
        return cls(d["steps"], d["prefill_tokens"], d["decode_tokens"], list(d["step_times_s"]),
                   list(d["batch_sizes"]), list(d["strategies"]), list(d["step_tokens"]), d["wall_time_s"],
                   {k: list(v) for k, v in d.get("draft_sources", {}).items()}, list(d.get("step_drafted", [])))


def add_sources(total: dict[str, list[int]], counts: dict[str, list[int]]) -> None:
    """Add per-source draft counts into `total`, element by element."""
    for name, values in counts.items():
        entry = total.setdefault(name, [0] * len(values))
        entry[:] = [a + b for a, b in zip(entry, values)]

