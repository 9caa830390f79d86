"""Per-request sampling parameters, named as in vLLM."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from tlt.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """n samples per prompt; temperature 0 is greedy; top_k <= 0 and top_p = 1 are off, and a top_k at or
    above the vocabulary size keeps every token. Generation stops at any of `stop_token_ids` or at the
    model's end-of-sequence ids (unless `ignore_eos`), after `max_tokens` tokens, or where the model's
    context (max_position_embeddings) is full, whichever comes first (finish reason "length" for the
    last two). `seed` (an integer in [0, 2**64)) fixes this request's randomness whatever else shares
    the batch; `return_hidden_states` returns the target's last-layer feature of every token. A value
    of the wrong type or out of range is an error naming the field: nothing is rounded or clamped."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    seed: int | None = None
    return_hidden_states: bool = False

    def __post_init__(self) -> None:
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (list, tuple, set, frozenset, range)):
            raise ConfigError(f"SamplingParams field 'stop_token_ids' must be a list of token ids, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stop))
        checks = [
            ("n", integral(self.n) and self.n >= 1, "an integer >= 1"),
            ("temperature", _real(self.temperature) and 0 <= self.temperature < math.inf, "a finite number >= 0"),
            ("top_p", _real(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", integral(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "-1 (off) or an integer >= 1"),
            ("max_tokens", integral(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("stop_token_ids", all(integral(t) and t >= 0 for t in self.stop_token_ids), "token ids (integers >= 0)"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "true or false"),
            ("seed", self.seed is None or (integral(self.seed) and 0 <= self.seed < 1 << 64), "None or an integer in [0, 2**64)"),
            ("return_hidden_states", isinstance(self.return_hidden_states, bool), "true or false"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"SamplingParams field {name!r} must be {expected}, got {getattr(self, name)!r}")
        for name in ("n", "top_k", "max_tokens", "seed"):  # numpy integers become Python ints
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def integral(value: object) -> bool:
    """An int (numpy's too), not a bool and not a float that happens to be whole."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
