"""`Episode`: one sampled response with everything the update needs, and packing episodes for training.

A step's episodes are plain records (token ids, floats, the example), so they can cross a
process boundary. `pack` lays episodes end to end into rows of at most `row_tokens` tokens (first fit,
longest first); position ids restart at 0 for each episode, which the model turns into a
block-diagonal causal mask, so no token attends across episodes. Rows of similar length then share a
micro-batch, so little compute goes to padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.data import Example


@dataclass
class Episode:
    group: int  # index of the prompt within the step
    example: Example
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # per completion token, under the warped distribution it was sampled from
    finish_reason: str
    text: str
    reward: float = 0.0
    reward_error: str | None = None
    advantage: float = 0.0
    acceptance_length: float | None = None


@dataclass
class MicroBatch:
    """Packed rows for one forward: input_ids and position_ids [R, L]; logit_index [R, K] the positions
    whose logits predict a response token (the position before it), valid where target_mask [R, K];
    the response tokens, flattened in row-major order, belong to `episodes` in that order."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logit_index: torch.Tensor
    target_mask: torch.Tensor
    episodes: list[Episode]

    def targets(self) -> torch.Tensor:
        """The response token ids [N], flat in episode order."""
        return self.input_ids.gather(1, self.logit_index + 1)[self.target_mask]


def pack(episodes: list[Episode], row_tokens: int, micro_batch_tokens: int) -> list[MicroBatch]:
    """Micro-batches of rows of whole episodes. A row holds at most `row_tokens` tokens unless one
    episode alone is longer (short rows keep attention cheap: its cost grows with the row length
    squared); a micro-batch holds rows of similar length up to `micro_batch_tokens` tokens in all."""
    size = [len(e.prompt_ids) + len(e.completion_ids) for e in episodes]
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(episodes)), key=lambda i: -size[i]):
        slot = next((r for r, room in enumerate(free) if room >= size[i]), None)
        if slot is None:
            rows.append([])
            free.append(max(row_tokens, size[i]))
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= size[i]
    # Within a row, keep the step's episode order, so results do not depend on packing details.
    rows = [sorted(r) for r in rows]
    lengths = [sum(size[i] for i in r) for r in rows]
    batches, current, longest = [], [], 0
    for r in sorted(range(len(rows)), key=lambda r: -lengths[r]):
        longest = max(longest, lengths[r]) if current else lengths[r]
        if current and longest * (len(current) + 1) > micro_batch_tokens:
            batches.append(current)
            current, longest = [], lengths[r]
        current.append(rows[r])
    if current:
        batches.append(current)
    return [_micro_batch([[episodes[i] for i in r] for r in b]) for b in batches]


def _micro_batch(rows: list[list[Episode]]) -> MicroBatch:
    L = max(sum(len(e.prompt_ids) + len(e.completion_ids) for e in r) for r in rows)
    K = max(sum(len(e.completion_ids) for e in r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    pos = torch.zeros(len(rows), L, dtype=torch.long)
    index = torch.zeros(len(rows), K, dtype=torch.long)
    mask = torch.zeros(len(rows), K, dtype=torch.bool)
    for r, members in enumerate(rows):
        at, k = 0, 0
        for e in members:
            tokens = e.prompt_ids + e.completion_ids
            ids[r, at : at + len(tokens)] = torch.tensor(tokens)
            pos[r, at : at + len(tokens)] = torch.arange(len(tokens))
            start = at + len(e.prompt_ids) - 1
            index[r, k : k + len(e.completion_ids)] = torch.arange(start, start + len(e.completion_ids))
            mask[r, k : k + len(e.completion_ids)] = True
            at, k = at + len(tokens), k + len(e.completion_ids)
        # Padding continues the last episode's positions: it forms no new sequence and, coming after
        # every real token of the row, is seen by none of them.
        pos[r, at:] = torch.arange(pos[r, at - 1] + 1, pos[r, at - 1] + 1 + L - at)
    return MicroBatch(ids, pos, index, mask, [e for members in rows for e in members])
