"""The online buffer: what rollout already computed, kept for the drafter to learn from.

Every generated response comes back from the rollout workers with the target's last-layer feature of
each of its tokens (`return_hidden_states`): the decode and verify forwards produce them anyway, so
the buffer costs no target forward. An entry is one response as a `DraftRecord`, tagged with the
policy version that wrote it.

Bounds. After each `add`, the eviction policy (a callable: entries -> the entries to keep) runs; the
default `keep_recent(2)` keeps the responses of the last two policy versions, because older ones
describe a policy the drafter no longer has to follow. Then the byte bound drops the oldest entries
(lowest version, then first added) until the features and tokens fit `max_bytes`.

Persistence. `save(folder)` / `load(folder)` write and read the entries exactly (tokens, features,
versions, arrival order, counters) as one safetensors file and a JSON index, so a resumed run trains
its drafter on the very data the uninterrupted run would have.

Sampling. The sampling policy (a callable: entries -> one weight each) sets how often a response's
window is drawn into a training row. The default `favour_long(1.0)` weights a response by its
length, so every token is equally likely and the long responses, which are the long tail and take
most of the decoding time, supply most of the training signal. Windows are the last `window` pairs
of a response, packed back to back into rows with attention blocked across them (speculative/data.py).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tlt.errors import ConfigError
from tlt.speculative.data import DraftRecord, PackedBatch, Pairs, fill_rows, pack, record_pairs


@dataclass
class Entry:
    record: DraftRecord
    version: int  # the policy version that generated it
    order: int  # arrival order, for ties in eviction

    @property
    def pairs(self) -> int:
        return max(self.record.tokens.shape[0] - 1, 0)

    @property
    def nbytes(self) -> int:
        r = self.record
        total = r.tokens.numel() * r.tokens.element_size() + r.features.numel() * r.features.element_size()
        return total + (0 if r.layers is None else r.layers.numel() * r.layers.element_size())


BUFFER_FORMAT = "tlt-online-buffer-1"
EvictionPolicy = Callable[[Sequence[Entry]], list[Entry]]
SamplingPolicy = Callable[[Sequence[Entry]], list[float]]


def keep_recent(versions: int = 2) -> EvictionPolicy:
    """Keep the entries of the newest `versions` policy versions present."""
    if versions < 1:
        raise ConfigError(f"keep_recent: versions must be >= 1, got {versions}")

    def policy(entries: Sequence[Entry]) -> list[Entry]:
        recent = sorted({e.version for e in entries})[-versions:]
        return [e for e in entries if e.version in recent]

    return policy


def favour_long(power: float = 1.0) -> SamplingPolicy:
    """Weight a response by (its pair count) ** power: 1 draws every token alike, > 1 favours long ones more."""
    if power < 0:
        raise ConfigError(f"favour_long: power must be >= 0, got {power}")
    return lambda entries: [float(e.pairs) ** power for e in entries]


class OnlineBuffer:
    def __init__(self, max_bytes: int = 256 << 20, evict: EvictionPolicy | None = None,
                 sample: SamplingPolicy | None = None) -> None:
        if max_bytes < 1:
            raise ConfigError(f"OnlineBuffer: max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self.evict = evict or keep_recent(2)
        self.sample = sample or favour_long(1.0)
        self.entries: list[Entry] = []
        self._arrivals = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def pairs(self) -> int:
        return sum(e.pairs for e in self.entries)

    @property
    def versions(self) -> list[int]:
        return sorted({e.version for e in self.entries})

    def add(self, records: Sequence[DraftRecord], version: int) -> None:
        """Add one batch of responses written by policy `version`; responses with no pair are skipped."""
        for r in records:
            if r.tokens.shape[0] >= 2:
                self.entries.append(Entry(r, int(version), self._arrivals))
                self._arrivals += 1
        before = len(self.entries)
        kept = self.evict(self.entries)
        if not kept and self.entries:
            raise ConfigError("the buffer's eviction policy kept nothing; it must keep at least the newest entries")
        self.entries = kept
        if self.nbytes > self.max_bytes:
            by_age = sorted(self.entries, key=lambda e: (e.version, e.order))
            total = sum(e.nbytes for e in by_age)
            drop = set()
            for e in by_age:
                if total <= self.max_bytes:
                    break
                drop.add(e.order)
                total -= e.nbytes
            self.entries = [e for e in self.entries if e.order not in drop]
        self.evicted += before - len(self.entries)

    def stats(self) -> dict:
        return {"responses": len(self.entries), "pairs": self.pairs, "bytes": self.nbytes,
                "versions": self.versions, "evicted": self.evicted}

    # --- persistence ---------------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike) -> None:
        """Write the entries to folder/buffer.safetensors and folder/buffer.json (atomically each)."""
        import torch
        from safetensors.torch import save

        from tlt.io import atomic_write_bytes, atomic_write_json

        folder = Path(folder)
        tensors = {}
        for j, e in enumerate(self.entries):
            # copies: a record's tensors may be views into a larger rollout tensor, which safetensors refuses
            tensors[f"{j}.tokens"] = e.record.tokens.detach().to("cpu", torch.long).clone()
            tensors[f"{j}.features"] = e.record.features.detach().cpu().clone()
            if e.record.layers is not None:
                tensors[f"{j}.layers"] = e.record.layers.detach().cpu().clone()
        index = {"format": BUFFER_FORMAT, "arrivals": self._arrivals, "evicted": self.evicted,
                 "entries": [{"version": e.version, "order": e.order, "prompt_len": int(e.record.prompt_len),
                              "layer_ids": list(e.record.layer_ids)} for e in self.entries]}
        atomic_write_bytes(folder / "buffer.safetensors", save(tensors, metadata={"format": "pt"}))
        atomic_write_json(folder / "buffer.json", index)

    def load(self, folder: str | os.PathLike) -> None:
        """Replace the entries with those `save` wrote to `folder`; errors name the file and what is wrong."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from tlt.errors import CheckpointError
        from tlt.model.checkpoint import read_json

        folder = Path(folder)
        index_path, weights = folder / "buffer.json", folder / "buffer.safetensors"
        index = read_json(index_path)
        if index.get("format") != BUFFER_FORMAT:
            raise CheckpointError(f"{index_path}: field 'format' is {index.get('format')!r}, expected {BUFFER_FORMAT!r}")
        try:
            tensors = load_file(str(weights))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{weights}: cannot read the buffer's tensors ({exc})") from None
        entries = []
        for j, meta in enumerate(index.get("entries", [])):
            try:
                tokens, features = tensors[f"{j}.tokens"], tensors[f"{j}.features"]
                record = DraftRecord(tokens, features, int(meta["prompt_len"]), tensors.get(f"{j}.layers"),
                                     tuple(meta.get("layer_ids", ())))
                entries.append(Entry(record, int(meta["version"]), int(meta["order"])))
            except KeyError as exc:
                raise CheckpointError(f"{index_path}: entry {j} has no {exc.args[0]!r} in {weights.name} or the index") from None
            if features.shape[0] != tokens.shape[0]:
                raise CheckpointError(f"{weights}: entry {j} has {tokens.shape[0]} tokens but {features.shape[0]} feature rows")
        self.entries, self._arrivals, self.evicted = entries, int(index["arrivals"]), int(index["evicted"])


def sampled_batches(entries: Sequence[Entry], weights: Sequence[float], rows: int, row_tokens: int,
                    window: int, seed: int) -> Iterator[PackedBatch]:
    """Endless packed batches of `rows` rows; each window is the last `window` pairs of a response drawn
    with probability proportional to its weight."""
    usable = [(e, w) for e, w in zip(entries, weights) if e.pairs and w > 0]
    if not usable:
        raise ConfigError("the buffer has no response with 2 or more tokens and a positive sampling weight")
    if window > row_tokens:
        raise ConfigError(f"window ({window}) must fit a row of {row_tokens} pairs")
    pairs: list[Pairs] = [record_pairs(e.record, window) for e, _ in usable]
    cumulative, total = [], 0.0
    for _, w in usable:
        total += w
        cumulative.append(total)
    rng = random.Random(seed)

    def stream() -> Iterator[Pairs]:
        while True:
            yield from rng.choices(pairs, cum_weights=cumulative, k=256)

    rows_out = fill_rows(stream(), row_tokens)
    while True:
        yield pack([next(rows_out) for _ in range(rows)], row_tokens)

