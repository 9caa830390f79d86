"""Per-step metrics: a JSONL file always, TensorBoard when installed and asked, a console table.

`metrics.jsonl` holds one object per step, appended and flushed as each step ends. On resume the rows
past the checkpoint (steps a killed run did not save) are dropped by rewriting the file atomically, so
the file always describes one consistent run. Scalars go to TensorBoard under the same names; lists
and dicts (the live-batch profile, strategy counts) stay in the JSONL.
"""

from __future__ import annotations

import json
from pathlib import Path

from tlt.io import atomic_write_bytes

COLUMNS = (  # (header, key, format) of the console table
    ("step", "step", "{:>5d}"),
    ("reward", "reward", "{:>6.3f}"),
    ("acc", "accuracy", "{:>5.2f}"),
    ("len", "response_length_mean", "{:>5.0f}"),
    ("p99", "response_length_p99", "{:>5.0f}"),
    ("max", "response_length_max", "{:>5d}"),
    ("accept", "acceptance_length", "{:>6.2f}"),
    ("tok/s", "tokens_per_s", "{:>6.0f}"),
    ("step s", "time_step_s", "{:>6.2f}"),
    ("rollout", "time_rollout_s", "{:>7.2f}"),
    ("update", "time_update_s", "{:>6.2f}"),
    ("eval acc", "eval_accuracy", "{:>8.3f}"),
    ("greedy", "eval_greedy_accuracy", "{:>6.3f}"),
)


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLog:
    def __init__(self, run_dir: Path | None, tensorboard: bool = False, keep_until: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl" if run_dir is not None else None
        self.rows: list[dict] = []
        if self.path is not None and keep_until is not None:
            self.rows = [r for r in read_metrics(self.path) if r.get("step", 0) <= keep_until]
            atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in self.rows).encode())
        elif self.path is not None:
            atomic_write_bytes(self.path, b"")
        self.writer = None
        if tensorboard and run_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("tensorboard=true needs the tensorboard package (pip install tensorboard)") from exc
            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.writer.add_scalar(key, value, row["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def table_header() -> str:
    return "  ".join(f"{h:>{len(f.format(0) if 'd' in f else f.format(0.0))}}" for h, _, f in COLUMNS)


def table_row(row: dict) -> str:
    cells = []
    for _, key, fmt in COLUMNS:
        width = len(fmt.format(0) if "d" in fmt else fmt.format(0.0))
        value = row.get(key)
        cells.append(fmt.format(value) if value is not None else " " * (width - 1) + "-")
    return "  ".join(cells)
