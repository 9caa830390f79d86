"""The engine's configuration: batch limits, the KV budget, seeding, and which decoder runs (plain,
speculative with one strategy, or adaptive) with its drafter and tuner."""

from __future__ import annotations

from dataclasses import dataclass

from tlt.errors import ConfigError
from tlt.rollout.params import integral


@dataclass(frozen=True)
class EngineConfig:
    """max_batch_size: live sequences at most; kv_budget_tokens: worst-case cached tokens at most
    (None: unlimited); cache_block: KV cache capacity granularity; seed: draws seeds for requests
    without one (None: fresh entropy); progress: None shows a bar when stderr is a terminal.
    speculative: "off", "on" (every step uses `strategy`, a Strategy or its name such as
    "tree-d6-k4-v24"; None: Strategy()'s tree-d6-k4-v24) or "adaptive" (a tuner picks each step's
    strategy by live batch size; tuner: a TunerConfig, max_draft_tokens: the memory guard on draft
    tokens x live rows); drafter: a Drafter, a drafter folder or "default" (needed by chain and tree
    strategies). `strategy` is read only with "on" and `tuner` only with "adaptive". A request for more
    samples than max_batch_size runs in parts (scheduler.py). catch_up_window: a drafting
    step after plain ones feeds the drafter at most this many of the pairs each row queued meanwhile,
    the newest (None: all); see SpeculativeDecoder. drafter_window: the drafter's attention keeps each
    row's newest `drafter_window` pairs once it holds twice that many ("auto": a quarter of the window the
    drafter was trained over, as its config records it, so it attends over at most half of it; None, or
    "auto" for a drafter that records none: the whole context; see SpeculativeDecoder: drafts only, the
    samples are unchanged). drafter_bits: 4 drafts on the drafter's weights
    rounded to 4 bits where tlt's CPU kernels run it (a quarter of bf16 weights' bytes, an eighth of float32
    ones'; the samples are unchanged, verification being the target's), 16 on its weights as they are
    (Drafter.set_weight_bits; a Drafter object given here is set to that width, so engines sharing one share its width)."""

    max_batch_size: int = 256
    kv_budget_tokens: int | None = None
    cache_block: int = 64
    seed: int | None = None
    progress: bool | None = None
    speculative: str = "off"
    strategy: object | None = None
    drafter: object | None = None
    tuner: object | None = None
    max_draft_tokens: int = 8192
    catch_up_window: int | None = 16
    drafter_window: int | str | None = "auto"
    drafter_bits: int = 16

    def __post_init__(self) -> None:
        if self.speculative not in ("off", "on", "adaptive"):
            raise ConfigError(f"EngineConfig field 'speculative' must be off, on or adaptive, got {self.speculative!r}")
        for name in ("max_batch_size", "kv_budget_tokens", "cache_block", "max_draft_tokens"):
            value = getattr(self, name)
            if not (name == "kv_budget_tokens" and value is None) and (not integral(value) or value < 1):
                none = " or None" if name == "kv_budget_tokens" else ""
                raise ConfigError(f"EngineConfig field {name!r} must be an integer >= 1{none}, got {value!r}")
        if self.seed is not None and not integral(self.seed):
            raise ConfigError(f"EngineConfig field 'seed' must be an integer or None, got {self.seed!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ConfigError(f"EngineConfig field 'progress' must be true, false or None, got {self.progress!r}")
        if self.speculative == "on" and self.drafter is None:
            from tlt.speculative.strategy import Strategy

            strategy = self.strategy or Strategy()
            strategy = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
            if strategy.uses_drafter:
                raise ConfigError(f"EngineConfig field 'strategy' {strategy.name!r} needs a drafter (chain and tree "
                                  "strategies draft with a learned one): give drafter= (a Drafter, a folder or "
                                  "'default'), or a model-free strategy such as ngram-d4")
        if not integral(self.drafter_bits) or self.drafter_bits not in (4, 16):
            raise ConfigError(f"EngineConfig field 'drafter_bits' must be 4 or 16, got {self.drafter_bits!r}")
        for name, words in (("catch_up_window", (None,)), ("drafter_window", (None, "auto"))):
            window = getattr(self, name)
            if window not in words and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
                raise ConfigError(f"EngineConfig field {name!r} must be an int >= 1 or one of {words}, got {window!r}")
