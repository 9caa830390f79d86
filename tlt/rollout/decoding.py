"""The seam between the engine and its decoders: the `Decoder` protocol and what crosses it.

The engine owns the batch (admission, prefill, appending tokens, dropping finished rows); a decoder
turns the live batch into new tokens. Everything the engine asks of a decoder is in `Decoder`, and
every decoder (`PlainDecoder` here, speculative.decoder's `SpeculativeDecoder`, adaptive.decoder's
`AdaptiveDecoder`) has every member, so the engine never probes one. A decoder's own per-row state
(drafting indexes, acceptance counters, the drafter's cache) is created by the decoder and carried by
the engine without reading it: per sequence in `Sequence.state`, per live batch in `LiveBatch.state`.

The engine imports no decoder but the plain one: `make_decoder` imports the speculative and adaptive
decoders only when a config names them, so the rollout package stays below them in the import graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from tlt.errors import ConfigError
from tlt.rollout import rng
from tlt.rollout.batch import LiveBatch
from tlt.rollout.config import EngineConfig
from tlt.rollout.sampling import sample_tokens
from tlt.rollout.sequence import Sequence


@dataclass
class DecodeResult:
    """Per live row: the new tokens, their log-probs and (when asked) the features that produced them:
    last-layer `hidden` [k, H] and, for a drafter reading intermediate layers, `layers` [k, L, H]."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    hidden: list[torch.Tensor] | None
    strategy: str = "off"  # the strategy of the step ("off": one plain token per row)
    layers: list[torch.Tensor] | None = None
    visited: list[list[int]] | None = None  # per row, the draft nodes on the accepted path (root first)
    sources: dict | None = None  # draft source -> [row-steps, tokens, accepted draft tokens] (suffix drafts)
    drafted: int = 0  # draft tokens the step's verification held, over all rows (roots and padding not counted)
    seconds: float = 0.0  # the step's time, drafting and verification (SpeculativeDecoder.decode)


@runtime_checkable
class Decoder(Protocol):
    """What the engine calls, in the order of a rollout: `start` once per generate call, `prefill` for
    every admitted set of groups, `decode` every step, `appended` after every append of tokens, and
    `acceptance_length` when a sequence's completion is built. `output_layers` are the target layers
    whose outputs the prefill forward must return; `drafter` (the learned drafter, or None), `tuner`
    (the adaptive tuner, or None), `calibration` (the suffix drafts' speculative.suffix.Calibration, or
    None) and `costs` (speculative.cost.StepCosts, the measured cost of a verified token where a "-pa" arm
    drafts by it, or None) are what
    the engine exposes of it."""

    output_layers: tuple[int, ...]
    drafter: torch.nn.Module | None
    tuner: object | None
    calibration: object | None
    costs: object | None

    def start(self, prompts: list[list[int]], samples: list[int], history) -> list[list[object | None]]:
        """Per prompt, the state of each of its `samples` rows (None: the decoder keeps none). `history`
        (speculative.history.HistoryDrafts or None) holds earlier responses drafts may come from."""
        ...

    def prefill(self, batch: LiveBatch, ids: torch.Tensor, lengths: torch.Tensor, out, counts: torch.Tensor) -> None:
        """Freshly prefilled rows: prompts `ids` [G, T] of `lengths` [G], the forward's output `out`,
        `counts` [G] rows per prompt; `batch` holds the forked rows and their first tokens."""
        ...

    def decode(self, batch: LiveBatch) -> DecodeResult:
        """New tokens for every live row; the cache is left holding all but each row's newest token."""
        ...

    def appended(self, seqs: list[Sequence], kept: list[int]) -> None:
        """The engine appended the last `kept[b]` tokens of `seqs[b]` (a stop token or the length limit
        may cut what was decoded)."""
        ...

    def acceptance_length(self, seq: Sequence) -> float | None:
        """Tokens per speculative step of `seq` (None: it took none)."""
        ...

    def load_drafter(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a drafter's trainable weights into the decoder's drafter in place."""
        ...


def stacked_layers(out, layers) -> torch.Tensor | None:
    """[B, T, L, H]: a forward's outputs of target layers `layers` (None when there are none)."""
    return torch.stack([out.layer_states[i] for i in layers], 2) if layers else None


def sample_next(batch: LiveBatch, logits: torch.Tensor, hidden: torch.Tensor,
                layers: torch.Tensor | None = None) -> DecodeResult:
    """One token per row from logits [B, V] with each row's counter-based uniform; hidden [B, H] (and
    layers [B, L, H]) are the features that produced them. Shared by the prefill's first token and
    every plain decode step."""
    u = rng.uniform(batch.keys, batch.counters)
    tokens, logprobs = sample_tokens(logits, batch.temperature, batch.top_k, batch.top_p, u)
    wants = batch.wants_hidden
    return DecodeResult([[t] for t in tokens.tolist()], [[lp] for lp in logprobs.tolist()],
                        [h[None] for h in hidden] if wants else None,
                        layers=[x[None] for x in layers] if wants and layers is not None else None)


class PlainDecoder:
    """One target forward per step: feed each row's newest token, sample the next one. It keeps no
    state and has no drafter."""

    output_layers: tuple[int, ...] = ()
    drafter = None
    tuner = None
    calibration = None
    costs = None

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def start(self, prompts: list[list[int]], samples: list[int], history) -> list[list[None]]:
        return [[None] * n for n in samples]

    def prefill(self, batch: LiveBatch, ids: torch.Tensor, lengths: torch.Tensor, out, counts: torch.Tensor) -> None:
        pass

    def decode(self, batch: LiveBatch) -> DecodeResult:
        out = self.model(batch.last_tokens[:, None], cache=batch.cache)
        return sample_next(batch, out.logits[:, 0], out.hidden_states[:, 0])

    def appended(self, seqs: list[Sequence], kept: list[int]) -> None:
        pass

    def acceptance_length(self, seq: Sequence) -> None:
        return None

    def load_drafter(self, state: dict[str, torch.Tensor]) -> None:
        raise ConfigError("load_drafter: the engine has no learned drafter (speculative off or n-gram only)")


def make_decoder(model: torch.nn.Module, config: EngineConfig, log: Callable[[str], None]) -> Decoder:
    """The decoder `config.speculative` names ("off", "on", "adaptive"); `log` takes the tuner's reports."""
    if config.speculative == "off":
        return PlainDecoder(model)
    if config.speculative == "on":
        from tlt.speculative.decoder import SpeculativeDecoder

        return SpeculativeDecoder.from_config(model, config)
    from tlt.adaptive.decoder import AdaptiveDecoder

    return AdaptiveDecoder.from_config(model, config, log)
