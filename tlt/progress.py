"""A minimal progress bar on stderr, drawn only when stderr is a terminal (or when forced)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, enabled: bool | None = None, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total, self.label, self.done = max(total, 1), label, 0
        self.start = self.last_draw = time.perf_counter()
        self.note = ""

    def update(self, done: int, note: str = "") -> None:
        self.done, self.note = done, note
        now = time.perf_counter()
        if self.enabled and (now - self.last_draw > 0.1 or done >= self.total):
            self.last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} {now - self.start:5.1f}s {self.note}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
