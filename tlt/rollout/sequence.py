"""Records of generation: the live `Sequence` the engine updates, and the outputs it returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tlt.rollout.params import SamplingParams


@dataclass
class Completion:
    """One sample. `logprobs[i]` is token i's log-prob under the warped distribution it was drawn from.
    `hidden_states[i]` ([n_tokens, H], when asked) is the target's last-layer feature that produced
    token i, i.e. at the position just before it (the prompt's last position for token 0);
    `layer_states` ([n_tokens, L, H]) the outputs of the target layers an EAGLE-3 drafter reads, at the
    same positions, when the engine's drafter reads any."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    text: str | None = None
    hidden_states: torch.Tensor | None = None
    acceptance_length: float | None = None  # tokens per speculative step of this sample (None: none)
    layer_states: torch.Tensor | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[Completion]
    prompt: str | None = None


@dataclass
class Sequence:
    request_id: int
    index: int  # sample index within its request
    prompt: list[int]
    params: SamplingParams
    key: int  # counter-based RNG key (see rng.py)
    stop_ids: frozenset[int]
    max_new: int  # max_tokens, clipped to the model's context
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    layers: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    state: object | None = None  # the decoder's per-row state (Decoder.start), opaque to the engine

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def append(self, tokens: list[int], logprobs: list[float], hidden: torch.Tensor | None,
               layers: torch.Tensor | None = None) -> int:
        """Add accepted tokens up to the first stop token or the length limit; return how many were kept."""
        kept = 0
        for tok, lp in zip(tokens, logprobs):
            self.tokens.append(tok)
            self.logprobs.append(lp)
            kept += 1
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            if len(self.tokens) >= self.max_new:
                self.finish_reason = "length"
                break
        if hidden is not None and self.params.return_hidden_states:
            self.hidden.append(hidden[:kept])
            if layers is not None:
                self.layers.append(layers[:kept])
        return kept

    def completion(self, tokenizer=None, acceptance_length: float | None = None) -> Completion:
        text = tokenizer.decode(self.tokens) if tokenizer is not None else None
        hidden = torch.cat(self.hidden) if self.hidden else None
        layers = torch.cat(self.layers) if self.layers else None
        return Completion(self.index, list(self.tokens), list(self.logprobs), self.finish_reason or "length",
                          text, hidden, acceptance_length, layers)
