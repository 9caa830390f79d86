"""The model-free drafter: continue the longest earlier match of the sequence's suffix.

Reasoning samples repeat themselves (a running value is copied into the next step) and the G samples
of one GRPO prompt share much text, so the tokens that followed the last occurrence of the current
suffix are good guesses at no model cost. One `NgramIndex` per request group maps every n-gram
(min_n <= n <= max_n) that has a continuation to its most recent (text, end) occurrence, over the prompt
and all the group's samples, so a lookup costs O(max_n) dict probes. Arriving tokens are logged and
indexed at the next lookup, in arrival order, which gives the very table indexing each at once would:
texts only grow, so a logged span reads the same later. An adaptive engine that rarely picks n-gram
drafting thus pays nothing per plain step (indexing every token cost ~2% of a 128-row decode step).
A draft is a chain, verified target-only like a tree with one branch (verify.walk).
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, prompt: list[int], min_n: int = 1, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.table: dict[tuple[int, ...], tuple[list[int], int]] = {}
        self.prompt = list(prompt)
        self._log: list[tuple[list[int], int, int]] = [(self.prompt, 0, len(self.prompt))]  # not yet indexed

    def _index(self, text: list[int], start: int, stop: int) -> None:
        """Record the n-grams ending at positions start <= end < stop (their continuation text[end] exists)."""
        for end in range(max(start, 1), stop):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.table[tuple(text[end - n : end])] = (text, end)

    def add(self, text: list[int], old_length: int) -> None:
        """`text` (a sample's prompt + tokens, a list that only grows) grew from old_length tokens."""
        self._log.append((text, old_length, len(text)))

    def propose(self, text: list[int], depth: int) -> list[int]:
        """Up to `depth` tokens following the most recent earlier match of text's longest suffix."""
        for span in self._log:
            self._index(*span)
        self._log.clear()
        for n in range(min(self.max_n, len(text)), self.min_n - 1, -1):
            hit = self.table.get(tuple(text[-n:]))
            if hit is not None:
                source, end = hit
                if source is not text:
                    return source[end : end + depth]
                # A match in the sequence itself continues past its end as an overlapping copy (LZ77
                # style): in a loop of period P the continuation repeats the last P tokens.
                out = []
                for i in range(depth):
                    j = end + i
                    out.append(text[j] if j < len(text) else out[j - len(text)])
                return out
        return []
