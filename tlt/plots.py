"""PNG plots written by the demo, the benchmarks and reports (matplotlib, headless backend)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike) -> Path:
    """Atomic: render to a temporary file beside the target, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
        fig.clf()
    return path


def length_histogram(lengths: list[int], path, title: str = "response lengths") -> Path:
    import numpy as np

    plt = _figure()
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
    plt.close(fig)
    return _save(fig, path)


def live_batch(series: dict[str, tuple[list[float], list[int]]], path, title: str = "live batch size") -> Path:
    """series: label -> (time of each step in seconds, live batch size at that step)."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, (times, sizes) in series.items():
        ax.step(times, sizes, where="post", label=label)
    ax.set_xlabel("seconds into the rollout")
    ax.set_ylabel("live sequences")
    ax.set_title(title)
    ax.legend()
    plt.close(fig)
    return _save(fig, path)


def strategy_by_batch(batch_sizes: list[int], strategies: list[str], path, title: str = "adaptive choice") -> Path:
    """Which strategy the adaptive engine ran at each live batch size (one dot per decode step)."""
    plt = _figure()
    names = sorted(set(strategies), key=lambda n: (n != "off", n))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, name in enumerate(names):
        xs = [b for b, s in zip(batch_sizes, strategies) if s == name]
        ax.scatter(xs, [i] * len(xs), s=8, alpha=0.4)
    ax.set_yticks(range(len(names)), names)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("live batch size")
    ax.set_title(title)
    plt.close(fig)
    return _save(fig, path)
