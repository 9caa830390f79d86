"""The history store: the run's earlier responses to each prompt, the suffix drafter's best source.

RL trains over a fixed dataset for several epochs, and a policy answers a prompt much as it did the
last time it saw it, so the responses of earlier steps are drafts that cost no model. The store keeps,
per prompt (keyed by a stable hash of its token ids, so any tokenizer and dataset work), the last
`responses` responses, each tagged with the policy version that sampled it. It is bounded in bytes:
past `mb` megabytes the oldest responses of the whole store go first, whatever their prompt.
Responses older than `max_age` policy versions are not drafted from (0: any age).

It lives with the driver of the run (the trainer), not in the engines: a rollout sends each prompt's
responses with the prompts as a plain `HistoryDrafts` record, so Ray workers need no state of their own,
and the store is saved in run checkpoints as plain lists (`state_dict`), so a resumed run drafts from
the very history the interrupted one had. `window` adds the run's most recent responses to any prompt
(the newest `window` of them that fit in `window_tokens`; 0 turns it off), a source for prompts seen for the
first time: on the bench policy's 64-problem x 4-epoch run the first epoch, which has no history of its
prompts, rolls out 1.20-1.23x as fast as the tuner without suffix arms with the window and 1.08x without it
(docs/results/README.md, "The window, and more history").
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

from tlt.config import check, check_int, check_numbers, setting
from tlt.errors import ConfigError

ENTRY_BYTES = 64  # bookkeeping per stored response, counted with its tokens
STATE_VERSION = 1


@dataclass(frozen=True)
class HistoryConfig:
    responses: int = setting(24, "responses kept per prompt, the newest (0: no history is kept)")
    mb: float = setting(64, "megabytes of responses in all, the oldest evicted first")
    max_age: int = setting(0, "policy versions a response may be old to be drafted from (0: any)")
    window: int = setting(128, "the run's most recent responses (any prompt) sent with every rollout (0: none)")
    window_tokens: int = setting(1 << 17, "tokens the window holds at most: its newest responses that fit (0: no cap); "
                                          "an engine's automaton over it takes about 500 bytes a token")

    def __post_init__(self) -> None:
        for name in ("responses", "max_age", "window", "window_tokens"):
            check_int(self, name, 0)
        check_numbers(self)
        check(self, "mb", self.mb > 0, "> 0")

    @property
    def max_bytes(self) -> int:
        return int(self.mb * (1 << 20))


@dataclass
class HistoryDrafts:
    """What a rollout drafts from besides its own group: per prompt, earlier responses (token lists),
    and `window`, recent responses to any prompt."""

    responses: list[list[list[int]]]
    window: list[list[int]] = field(default_factory=list)

    def select(self, rows: list[int]) -> "HistoryDrafts":
        """The record for the prompts `rows` (a worker's share)."""
        return HistoryDrafts([self.responses[i] for i in rows], self.window)


def prompt_key(prompt: list[int]) -> str:
    """A stable key of a prompt's token ids (the same in every process and run)."""
    return hashlib.sha256(array("q", prompt).tobytes()).hexdigest()[:32]


@dataclass
class _Entry:
    seq: int  # insertion order over the whole store
    version: int
    tokens: array

    @property
    def nbytes(self) -> int:
        return ENTRY_BYTES + self.tokens.itemsize * len(self.tokens)


class HistoryStore:
    def __init__(self, config: HistoryConfig | None = None) -> None:
        self.config = config or HistoryConfig()
        self._prompts: dict[str, deque[_Entry]] = {}
        self._order: OrderedDict[int, str] = OrderedDict()  # seq -> key, oldest first
        self._seq = 0
        self.nbytes = 0
        self.lookups = self.hits = 0  # prompts looked up by the last `drafts`, and those with history

    def __len__(self) -> int:
        return len(self._order)

    # --- writing -----------------------------------------------------------------------------------
    def add(self, prompt: list[int], responses: list[list[int]], version: int) -> None:
        """Record a prompt's new responses, sampled by policy `version`."""
        key = prompt_key(prompt)
        entries = self._prompts.setdefault(key, deque())
        for response in responses:
            entry = _Entry(self._seq, int(version), array("i", response))
            self._seq += 1
            entries.append(entry)
            self._order[entry.seq] = key
            self.nbytes += entry.nbytes
        while len(entries) > self.config.responses:
            self._drop(entries.popleft())
        while self.nbytes > self.config.max_bytes and self._order:
            seq, key = next(iter(self._order.items()))
            self._drop(self._prompts[key].popleft())  # a prompt's entries are in store order too
        if not entries:
            self._prompts.pop(key, None)

    def _drop(self, entry: _Entry) -> None:
        key = self._order.pop(entry.seq)
        self.nbytes -= entry.nbytes
        if not self._prompts[key]:
            del self._prompts[key]

    # --- reading -----------------------------------------------------------------------------------
    def responses(self, prompt: list[int], version: int | None = None) -> list[list[int]]:
        """The stored responses to `prompt`, oldest first; with `version` (the policy about to sample),
        those within max_age of it."""
        entries = self._prompts.get(prompt_key(prompt), ())
        age = self.config.max_age
        return [e.tokens.tolist() for e in entries if not age or version is None or version - e.version <= age]

    def drafts(self, prompts: list[list[int]], version: int | None = None) -> HistoryDrafts:
        """The record a rollout of `prompts` drafts from; counts its hits (prompts with history)."""
        responses = [self.responses(p, version) for p in prompts]
        self.lookups, self.hits = len(prompts), sum(1 for r in responses if r)
        window, tokens, cap = [], 0, self.config.window_tokens
        if self.config.window:
            for seq in reversed(self._order):
                if len(window) == self.config.window:
                    break
                key = self._order[seq]
                response = next(e for e in self._prompts[key] if e.seq == seq).tokens
                tokens += len(response)
                if cap and tokens > cap:
                    break
                window.append(response.tolist())
            window.reverse()
        return HistoryDrafts(responses, window)

    def stats(self) -> dict:
        """Size of the store, and the share of the last rollout's prompts it had responses for."""
        return {"history_prompts": len(self._prompts), "history_responses": len(self._order),
                "history_bytes": self.nbytes,
                "history_hit_rate": self.hits / self.lookups if self.lookups else None}

    # --- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain types: the config, and every response in store order as (key, version, token bytes)."""
        entries = []
        for seq, key in self._order.items():
            entry = next(e for e in self._prompts[key] if e.seq == seq)
            entries.append((key, entry.version, entry.tokens.tobytes()))
        return {"version": STATE_VERSION, "config": asdict(self.config), "entries": entries}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output into this store (its own bounds apply, the oldest going first)."""
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"history state version {state.get('version')!r} is not {STATE_VERSION}")
        self._prompts, self._order, self._seq, self.nbytes = {}, OrderedDict(), 0, 0
        for key, version, data in state["entries"]:
            tokens = array("i")
            tokens.frombytes(data)
            entry = _Entry(self._seq, int(version), tokens)
            self._seq += 1
            self._prompts.setdefault(key, deque()).append(entry)
            self._order[entry.seq] = key
            self.nbytes += entry.nbytes
        for key in list(self._prompts):
            entries = self._prompts.get(key)
            while entries and len(entries) > self.config.responses:
                self._drop(entries.popleft())
        while self.nbytes > self.config.max_bytes and self._order:
            _, key = next(iter(self._order.items()))
            self._drop(self._prompts[key].popleft())
