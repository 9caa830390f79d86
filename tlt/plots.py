"""PNG plots written by the demo, the benchmarks and reports (matplotlib, headless backend)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from tlt.io import atomic_write_bytes


def pyplot():
    """matplotlib.pyplot on the Agg backend, so plotting never needs a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Render `fig` to PNG bytes in memory and write them atomically: a reader never sees half a PNG."""
    path = Path(path)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    finally:
        pyplot().close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def length_histogram(lengths: list[int], path, title: str = "response lengths") -> Path:
    import numpy as np

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    a = np.asarray(lengths)
    ax.hist(a, bins=min(60, max(10, len(set(a.tolist())))), color="#3b6ea5")
    for q, style in ((50, "--"), (90, ":"), (99, "-.")):
        v = np.percentile(a, q)
        ax.axvline(v, color="#c0392b", linestyle=style, label=f"p{q} = {v:.0f}")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per response")
    ax.set_ylabel("responses (log)")
    ax.set_title(title)
    ax.legend()
    return save(fig, path)


def live_batch(series: dict[str, tuple[list[float], list[int]]], path, title: str = "live batch size") -> Path:
    """series: label -> (time of each step in seconds, live batch size at that step)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, (times, sizes) in series.items():
        ax.step(times, sizes, where="post", label=label)
    ax.set_xlabel("seconds into the rollout")
    ax.set_ylabel("live sequences")
    ax.set_title(title)
    ax.legend()
    return save(fig, path)


def strategy_by_batch(batch_sizes: list[int], strategies: list[str], path, title: str = "adaptive choice") -> Path:
    """Which strategy the adaptive engine ran at each live batch size (one dot per decode step)."""
    plt = pyplot()
    names = sorted(set(strategies), key=lambda n: (n != "off", n))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, name in enumerate(names):
        xs = [b for b, s in zip(batch_sizes, strategies) if s == name]
        ax.scatter(xs, [i] * len(xs), s=8, alpha=0.4)
    ax.set_yticks(range(len(names)), names)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("live batch size")
    ax.set_title(title)
    return save(fig, path)
