"""Adaptive speculative decoding: each step's strategy is chosen by the tuner from the live batch size.

The live batch of a rollout sweeps from large (where speculation costs more than it saves) to tiny
(where it wins most), and the best draft shape also moves with the drafter's quality. So every step
asks the bucketed bandit (tuner.py) for an arm, runs the speculative decoder with that strategy, and
pays the arm back with the step's accepted tokens per second (tokens emitted / decode time) and its
duration (what the tuner weighs exploration by: at large batch one tree step costs many plain ones). "off" is
an arm like any other, so the batch size at which speculation switches on is measured, not guessed.

Switching is free of target work: the speculative decoder feeds the drafter's pending pairs from every
step, plain ones included, and a drafter arm consumes them before drafting. A memory guard excludes
arms whose verification would hold more than `max_draft_tokens` draft tokens (nodes x live rows), and
arms that need a drafter are excluded when none is loaded.

Seam for accelerators: `Strategy` arms are hashable and the tuner buckets batch sizes, so a GPU runner
can capture one graph per (bucket, arm) it is actually used at; nothing here needs a GPU.
"""

from __future__ import annotations

import torch

from tlt.adaptive.tuner import Tuner, TunerConfig
from tlt.rollout.config import EngineConfig
from tlt.rollout.decoding import DecodeResult
from tlt.rollout.sequence import Sequence
from tlt.speculative.decoder import SpeculativeDecoder, drafter_for
from tlt.speculative.strategy import Strategy


class AdaptiveDecoder:
    """A rollout.decoding.Decoder: the tuner picks each step's strategy, `spec` (a SpeculativeDecoder)
    runs it and keeps the per-row state."""

    def __init__(self, spec: SpeculativeDecoder, tuner: Tuner, max_draft_tokens: int = 8192) -> None:
        self.spec, self.tuner, self.max_draft_tokens = spec, tuner, max_draft_tokens
        self.output_layers = spec.output_layers
        self.drafter = spec.drafter
        self.calibration = spec.calibration
        self.costs = spec.costs

    @classmethod
    def from_config(cls, model, config: EngineConfig, log) -> "AdaptiveDecoder":
        """The decoder of speculative="adaptive"; `log` takes the tuner's reports."""
        drafter = drafter_for(config, model)
        tuner = Tuner(config.tuner or TunerConfig(), log=log)
        spec = SpeculativeDecoder(model, drafter, Strategy(kind="off"), config.catch_up_window, config.drafter_window,
                                  measure_costs=any(arm.auto_floor for arm in tuner.arms), cost_buckets=tuner.bucket_of)
        return cls(spec, tuner, config.max_draft_tokens)

    def allowed(self, strategy: Strategy, batch_size: int) -> bool:
        if strategy.uses_drafter and self.spec.drafter is None:
            return False
        return strategy.kind == "off" or strategy.draft_tokens * batch_size <= self.max_draft_tokens

    # --- engine hooks: the speculative decoder's, with the tuner choosing the strategy ---------------
    def start(self, prompts: list[list[int]], samples: list[int], history) -> list[list[object]]:
        """The speculative decoder's rows; the first rollout that brings earlier responses makes the tuner
        forget what the arms drafting from them earned without them (Tuner.forget)."""
        if history is not None and any(history.responses) and not self.tuner.history_seen:
            self.tuner.history_seen = True
            arms = [arm for arm in self.tuner.arms if arm.uses_history]
            if arms:
                self.tuner.forget(arms)
                self.tuner.log(f"tuner: the first rollout with earlier responses; {', '.join(a.name for a in arms)} "
                               "measured afresh in every bucket")
        return self.spec.start(prompts, samples, history)

    def prefill(self, batch, ids, lengths, out, counts) -> None:
        self.spec.prefill(batch, ids, lengths, out, counts)

    def appended(self, seqs: list[Sequence], kept: list[int]) -> None:
        self.spec.appended(seqs, kept)

    def acceptance_length(self, seq: Sequence) -> float | None:
        return self.spec.acceptance_length(seq)

    def load_drafter(self, state: dict[str, torch.Tensor]) -> None:
        """Load the weights, then let the arms that use the drafter compete again where the tuner had
        pruned them: they were judged with the old one (their rewards fade by its decay)."""
        self.spec.load_drafter(state)
        self.tuner.unprune([arm for arm in self.tuner.arms if arm.uses_drafter])

    def decode(self, batch) -> DecodeResult:
        size = len(batch)
        arm = self.tuner.choose(size, allowed=lambda strategy: self.allowed(strategy, size))
        result = self.spec.decode(batch, arm)
        elapsed = max(result.seconds, 1e-9)
        self.tuner.update(size, arm, sum(map(len, result.tokens)) / elapsed, seconds=elapsed)
        return result
