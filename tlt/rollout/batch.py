"""The live batch: sequences being decoded, row-aligned with the KV cache and per-row tensors.

Row b of every member describes the same sequence: `seqs[b]`, cache row b, `last_tokens[b]` (the most
recent sampled token, not yet in the cache), the sampling tensors and row b of the decoder's `state`
(the speculative decoder's drafter cache and pending pairs; None for plain decoding), which the batch
only selects and extends. `select` and `extend` keep them aligned, so the engine never indexes one
without the others.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from tlt.model.kv_cache import KVCache
from tlt.rollout.sequence import Sequence


class BatchState(Protocol):
    """A decoder's state with one row per live row, kept aligned with the batch."""

    def select(self, rows: torch.Tensor) -> None: ...

    def extend(self, *others: "BatchState") -> None: ...


def fill_from_tail(alive: list[bool]) -> list[int]:
    """The rows to keep when only the `alive` ones go on: the alive rows among the first n (n of them in
    all) stay where they are and the alive rows past n fill the others' places, in order. Only as many rows
    move as died among the first n (keeping the order would move every row behind the first that died, a
    copy of their whole KV cache each time a response ends). A row's place in the batch does not change
    its samples: every row draws from its own key and counter."""
    n = sum(alive)
    tail = iter([b for b in range(n, len(alive)) if alive[b]])
    return [b if alive[b] else next(tail) for b in range(n)]


# The fixed cost of one prefill forward, in prompt tokens: a 10-token prompt alone costs about as much
# as 40 tokens of a long one (bench policy, bf16 kernels, 2 threads: 10 ms against 0.25 ms a token).
PREFILL_OVERHEAD_TOKENS = 32


def prefill_chunks(lengths: list[int], overhead: int = PREFILL_OVERHEAD_TOKENS) -> list[list[int]]:
    """The prompts (indices into `lengths`) of each right-padded prefill forward: a forward over prompts of
    lengths l costs about `overhead` + len(l) x max(l) token slots, and the chunks, runs of the prompts
    sorted by length, minimise the sum, shortest chunk first. The bench task's 16 prompts of 10 to 356
    tokens (1,370 in all) in one forward take 5,700 slots; in the 6 chunks chosen here 1,450. On tlt's CPU
    kernels a padded slot costs no products (the layers run on the real tokens, `Transformer._packed`), and
    there the chunks and one forward are about even: a one-token rollout of those prompts x 8 samples takes
    1.06 s in 6 chunks, 1.23 s as one forward (medians of 5, bench policy, 2 threads); elsewhere every slot
    is computed."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sorted_lengths = np.array([lengths[i] for i in order], dtype=np.int64)
    n = len(order)
    best = np.zeros(n + 1, dtype=np.int64)  # best[j]: the least cost of the first j sorted prompts
    start = np.zeros(n + 1, dtype=np.int64)  # where the last chunk of that best split starts
    for j in range(1, n + 1):
        first = np.arange(j)  # the last chunk is sorted prompts first .. j-1, padded to the (j-1)th length
        costs = best[:j] + overhead + (j - first) * sorted_lengths[j - 1]
        start[j] = int(np.argmin(costs))
        best[j] = costs[start[j]]
    chunks, j = [], n
    while j:
        chunks.append(sorted(order[start[j]:j]))  # a chunk's rows in the order the prompts came
        j = int(start[j])
    return chunks[::-1]


class LiveBatch:
    def __init__(self, seqs: list[Sequence], cache: KVCache, last_tokens: torch.Tensor) -> None:
        self.seqs, self.cache, self.last_tokens = seqs, cache, last_tokens
        device = last_tokens.device
        self.temperature = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long, device=device)
        self.top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=device)
        self.keys = torch.tensor([s.key for s in seqs], dtype=torch.long, device=device)
        self.state: BatchState | None = None  # the decoder's, when it keeps one (Decoder.prefill sets it)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def counters(self) -> torch.Tensor:
        """Tokens generated so far per row: the RNG counter of the next draw."""
        return torch.tensor([len(s.tokens) for s in self.seqs], dtype=torch.long, device=self.keys.device)

    @property
    def wants_hidden(self) -> bool:
        return any(s.params.return_hidden_states for s in self.seqs)

    def select(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.keys.device)
        self.seqs = [self.seqs[r] for r in rows]
        self.cache.select_rows(idx)
        for name in ("last_tokens", "temperature", "top_k", "top_p", "keys"):
            setattr(self, name, getattr(self, name)[idx])
        if self.state is not None:
            self.state.select(idx)

    def extend(self, *others: "LiveBatch") -> None:
        """Append the rows of `others`, in order (one copy of every cache, however many join)."""
        batches = [self, *others]
        self.seqs = [s for b in batches for s in b.seqs]
        self.cache = KVCache.concat([b.cache for b in batches])
        for name in ("last_tokens", "temperature", "top_k", "top_p", "keys"):
            setattr(self, name, torch.cat([getattr(b, name) for b in batches]))
        if self.state is not None:
            self.state.extend(*(b.state for b in others))
