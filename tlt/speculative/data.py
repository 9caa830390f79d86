"""Training data for drafters: records of (token, target feature) from rollouts, pairs, packing.

Data. A `DraftRecord` is one response y_0..y_{n-1} with the target features h_0..h_{n-1}, where h_i
is the last-layer feature that produced y_i (at position t = prompt_len + i - 1, just before y_i).
The rollout engine returns exactly these (`return_hidden_states=True`), so `collect` needs no extra
target forward. `records_from_texts` gets them from one target forward over text the policy did not
write (e.g. reference solutions). An EAGLE-3 drafter (`feature_layers`) reads fused intermediate-layer
outputs instead, which decoding does not return: for it alone the records are recomputed with one
target forward that also keeps those layers.

Pairing. The training pair at step i (i = 0..n-2) is

    input (h_i, y_i) at position t = prompt_len + i - 1  ->  target feature h_{i+1} and the target's
    token distribution softmax(lm_head(h_{i+1})), which predicts y_{i+1}

i.e. the feature at t goes with the token at t+1 (the one it produced); pairing it with the token at
t, as the public online trainer does, hides from the drafter the very token it must continue from.

Packing. A row of the batch holds several records' windows (the last `window` pairs of each) back to
back. The drafter's no-cache forward starts a new block of its block-diagonal mask wherever a
position id is 0, but a record's pairs start at prompt_len - 1 (or later, for a window), so each
window's positions are shifted to start at 0 within the row. RoPE makes attention depend only on
position differences, so the shift changes nothing inside a window (the packing test checks this).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from tlt.errors import ConfigError

@dataclass
class DraftRecord:
    """One response: tokens [n], features [n, H] (row i produced token i), the prompt's length, and
    for EAGLE-3 drafters the outputs of target layers `layer_ids` at the same positions [n, k, H]."""

    tokens: torch.Tensor
    features: torch.Tensor
    prompt_len: int
    layers: torch.Tensor | None = None
    layer_ids: tuple[int, ...] = ()


@dataclass
class Pairs:
    """The m training pairs of a record (or of its last window), in order."""

    tokens: torch.Tensor  # [m] y_i
    inputs: torch.Tensor  # [m, H] h_i
    targets: torch.Tensor  # [m, H] h_{i+1}
    positions: torch.Tensor  # [m] t = prompt_len + i - 1
    layers: torch.Tensor | None = None  # [m, k, H] target layer outputs at t

    def __len__(self) -> int:
        return self.tokens.shape[0]


def record_pairs(record: DraftRecord, window: int | None = None) -> Pairs:
    """Pairs (h_i, y_i) -> h_{i+1} for i = 0..n-2, the last `window` of them when given."""
    n = record.tokens.shape[0]
    start = 0 if window is None else max(0, n - 1 - window)
    i = torch.arange(start, n - 1)  # [m]
    return Pairs(
        record.tokens[i],
        record.features[i],
        record.features[i + 1],
        record.prompt_len - 1 + i,
        None if record.layers is None else record.layers[i],
    )


def records_from_ids(
    target, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
    output_layers: Sequence[int] = (), batch_size: int = 16,
) -> list[DraftRecord]:
    """Records from one target forward over each prompt + response (right-padded batches)."""
    device, limit = target.device, target.config.max_position_embeddings
    if any(len(p) == 0 for p in prompts):
        raise ConfigError("a prompt is empty: the first response token needs a prompt feature before it")
    records = []
    for s in range(0, len(prompts), batch_size):
        seqs = [list(p) + list(r) for p, r in zip(prompts[s : s + batch_size], responses[s : s + batch_size])]
        too_long = [len(q) for q in seqs if len(q) > limit]
        if too_long:
            raise ConfigError(f"a prompt + response has {too_long[0]} tokens; the model's context is {limit}")
        lengths = torch.tensor([len(q) for q in seqs], device=device)
        ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long, device=device)
        for j, q in enumerate(seqs):
            ids[j, : len(q)] = torch.tensor(q, device=device)
        valid = torch.arange(ids.shape[1], device=device)[None] < lengths[:, None]  # [B, T]
        with torch.no_grad():
            out = target(ids, attention_mask=valid, output_layers=tuple(output_layers),
                         logit_index=torch.zeros(len(seqs), 1, dtype=torch.long, device=device))
        for j, (p, r) in enumerate(zip(prompts[s : s + batch_size], responses[s : s + batch_size])):
            P, n = len(p), len(r)
            span = slice(P - 1, P - 1 + n)  # the features that produced r[0..n-1]
            layers = torch.stack([out.layer_states[k][j, span] for k in output_layers], 1) if output_layers else None
            records.append(DraftRecord(torch.tensor(list(r)), out.hidden_states[j, span].cpu(), P,
                                       None if layers is None else layers.cpu(), tuple(output_layers)))
    return records


def generation_params(prompts: int, samples_per_prompt: int, temperature: float, max_tokens: int, seed: int,
                      hidden: bool = False) -> list:
    """The sampling parameters `collect` draws with, one per prompt: a run with the same ones and a
    target-only speculative strategy draws the very same responses."""
    from tlt.rollout import SamplingParams

    return [SamplingParams(n=samples_per_prompt, temperature=temperature, max_tokens=max_tokens,
                           seed=seed * 1_000_003 + i, return_hidden_states=hidden) for i in range(prompts)]


def collect(
    target, tokenizer, prompts: Sequence[str | list[int]], samples_per_prompt: int = 4,
    temperature: float = 1.0, max_tokens: int = 768, seed: int = 0, output_layers: Sequence[int] = (),
) -> list[DraftRecord]:
    """The target's own generations as records; responses of fewer than 2 tokens give no pair and are
    dropped. `output_layers` (an EAGLE-3 drafter's `output_layers`) recomputes the features with one
    target forward that also keeps those layers; otherwise the engine's features are used as they are."""
    from tlt.rollout import EngineConfig, RolloutEngine

    engine = RolloutEngine(target, tokenizer, EngineConfig(progress=False))
    params = generation_params(len(prompts), samples_per_prompt, temperature, max_tokens, seed,
                               hidden=not output_layers)
    done = [(out.prompt_token_ids, c) for out in engine.generate(prompts, params) for c in out.outputs
            if len(c.token_ids) >= 2]
    if output_layers:
        return records_from_ids(target, [p for p, _ in done], [c.token_ids for _, c in done], output_layers)
    # clone() outside inference mode turns the engine's inference tensors into ordinary ones.
    return [DraftRecord(torch.tensor(c.token_ids), c.hidden_states.clone().cpu(), len(p)) for p, c in done]


def records_from_texts(
    target, tokenizer, prompts: Sequence[str | list[int]], completions: Sequence[str | list[int]],
    output_layers: Sequence[int] = (), append_eos: bool = True,
) -> list[DraftRecord]:
    """Records for completions the policy did not write, from a target forward over prompt + completion.
    Text completions get the end-of-sequence token appended (as generated responses end in it)."""
    if len(prompts) != len(completions):
        raise ConfigError(f"got {len(prompts)} prompts for {len(completions)} completions")

    def ids(text, completion: bool) -> list[int]:
        if not isinstance(text, str):
            return [int(t) for t in text]
        out = tokenizer.encode(text, add_special_tokens=not completion)
        return out + [tokenizer.eos_token_id] if completion and append_eos else out

    return records_from_ids(target, [ids(p, False) for p in prompts], [ids(c, True) for c in completions],
                            output_layers)


# --- packing ---------------------------------------------------------------------------------------
@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [R, L]
    positions: torch.Tensor  # [R, L], 0 at the start of each packed window
    mask: torch.Tensor  # [R, L] bool, real pairs
    inputs: torch.Tensor  # [R, L, H]
    targets: torch.Tensor  # [R, L, H]
    layers: torch.Tensor | None = None  # [R, L, k, H]

    def to(self, device, dtype=None) -> "PackedBatch":
        """On `device`; with `dtype`, the features (inputs, targets, layers) in that dtype too."""
        def move(t, floating: bool):
            return None if t is None else t.to(device, dtype if floating and dtype is not None else t.dtype)

        return PackedBatch(move(self.tokens, False), move(self.positions, False), move(self.mask, False),
                           move(self.inputs, True), move(self.targets, True), move(self.layers, True))


def fill_rows(pairs: Iterator[Pairs], row_tokens: int) -> Iterator[list[Pairs]]:
    """Group consecutive windows into rows of at most `row_tokens` pairs (each window must fit)."""
    row, used = [], 0
    for p in pairs:
        if row and used + len(p) > row_tokens:
            yield row
            row, used = [], 0
        row.append(p)
        used += len(p)
    if row:
        yield row


def _padded(parts: list[torch.Tensor], pad: int) -> torch.Tensor:
    return torch.cat(parts + [parts[0].new_zeros(pad, *parts[0].shape[1:])])


def pack(rows: list[list[Pairs]], row_tokens: int) -> PackedBatch:
    """Tensors of a batch of rows; positions restart at 0 per window (see the module docstring), and
    padding continues the last window's positions, so it starts no block of its own."""
    cols = []
    for row in rows:
        used = sum(len(p) for p in row)
        pad = row_tokens - used
        cols.append((
            _padded([p.tokens for p in row], pad),
            torch.cat([torch.arange(len(p)) for p in row] + [torch.arange(pad) + len(row[-1])]),
            torch.arange(row_tokens) < used,
            _padded([p.inputs for p in row], pad),
            _padded([p.targets for p in row], pad),
            None if row[0].layers is None else _padded([p.layers for p in row], pad),
        ))
    return PackedBatch(*(None if col[0] is None else torch.stack(col) for col in zip(*cols)))


def packed_batches(pairs: list[Pairs], rows: int, row_tokens: int, seed: int) -> Iterator[PackedBatch]:
    """Endless batches of `rows` rows, windows in a fresh random order each epoch."""
    rng = random.Random(seed)

    def shuffled() -> Iterator[Pairs]:
        while True:
            yield from rng.sample(pairs, len(pairs))

    row_stream = fill_rows(shuffled(), row_tokens)
    while True:
        yield pack([next(row_stream) for _ in range(rows)], row_tokens)


