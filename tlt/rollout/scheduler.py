"""Admission control for continuous batching.

Requests wait in FIFO order as groups (a prompt and its n samples). A group is admitted whole, when
the live batch has room for its n sequences (`max_batch_size`) and the KV budget has room for their
worst case (n x (prompt + max new tokens) tokens). Reserving the worst case means a running sequence
can never run out of cache, so nothing is ever evicted or corrupted. A request for more samples than
`max_batch_size` is queued as consecutive parts of at most that many (each prefilled when it is
admitted; a sample's output depends only on its seed and index, so the parts change nothing); a part
that could not fit the KV budget even in an empty engine is rejected up front with an error that says
why.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tlt.errors import ConfigError
from tlt.rollout.sequence import Sequence


@dataclass
class Group:
    request_id: int
    prompt: list[int]
    seqs: list[Sequence]

    @property
    def kv_tokens(self) -> int:
        return sum(len(s.prompt) + s.max_new for s in self.seqs)


class Scheduler:
    def __init__(self, max_batch_size: int, kv_budget_tokens: int | None) -> None:
        self.max_batch_size, self.kv_budget_tokens = max_batch_size, kv_budget_tokens
        self.waiting: deque[Group] = deque()

    def add(self, group: Group) -> None:
        size = self.max_batch_size
        parts = [Group(group.request_id, group.prompt, group.seqs[i:i + size]) for i in range(0, len(group.seqs), size)]
        for part in parts:
            if self.kv_budget_tokens is not None and part.kv_tokens > self.kv_budget_tokens:
                raise ConfigError(
                    f"request {group.request_id} needs {part.kv_tokens} KV tokens ({len(part.seqs)} samples admitted "
                    f"together x (prompt + max_tokens)) but kv_budget_tokens is {self.kv_budget_tokens}"
                )
        self.waiting.extend(parts)

    def admit(self, running: list[Sequence]) -> list[Group]:
        """Pop the waiting groups that fit next to `running`, in arrival order."""
        slots = self.max_batch_size - len(running)
        reserved = sum(len(s.prompt) + s.max_new for s in running)
        admitted = []
        while self.waiting:
            group = self.waiting[0]
            if len(group.seqs) > slots:
                break
            if self.kv_budget_tokens is not None and reserved + group.kv_tokens > self.kv_budget_tokens:
                break
            admitted.append(self.waiting.popleft())
            slots -= len(group.seqs)
            reserved += group.kv_tokens
        return admitted
