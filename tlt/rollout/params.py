"""Per-request sampling parameters, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from tlt.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """n samples per prompt; temperature 0 is greedy; top_k <= 0 and top_p = 1 are off.
    Generation stops at any of `stop_token_ids` or at the model's end-of-sequence ids (unless
    `ignore_eos`), or after `max_tokens` tokens. `seed` fixes this request's randomness whatever else
    shares the batch; `return_hidden_states` returns the target's last-layer feature of every token."""

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
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            ("n", isinstance(self.n, int) and self.n >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1), "-1 (off) or >= 1"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"SamplingParams field {name!r} must be {expected}, got {getattr(self, name)!r}")
