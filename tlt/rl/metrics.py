"""Per-step metrics: a JSONL file always, TensorBoard and Weights & Biases when asked, a console table.

`metrics.jsonl` holds one object per step, appended and flushed as each step ends. On resume the rows
past the checkpoint (steps a killed run did not save) are dropped by rewriting the file atomically, so
the file always describes one consistent run; a last row cut short by a kill during its write is left
out too (its step is past the checkpoint, since a step's row is written before its checkpoint). Scalars go to TensorBoard (RUN_DIR/tensorboard/) and
W&B (RUN_DIR/wandb/) under the same names; lists and dicts (the live-batch profile, strategy counts)
stay in the JSONL. The W&B run id is kept in RUN_DIR/wandb_run.json so a resumed run continues the
same W&B run; W&B ignores a step it already has, which resume would write again with equal values.
`WANDB_MODE=offline` keeps everything local (`wandb sync` uploads it later). The optional packages
are imported before metrics.jsonl is touched, so a missing one leaves no half-started run behind.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from tlt.errors import ConfigError
from tlt.io import atomic_write_bytes, atomic_write_json

COLUMNS = (  # (header, key, format) of the console table
    ("step", "step", "{:>5d}"),
    ("reward", "reward", "{:>6.3f}"),
    ("rew err", "reward_errors", "{:>7d}"),
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


def read_metrics(path: Path, note=None) -> list[dict]:
    """The rows of a metrics.jsonl ([] when there is none). A last line that is not valid JSON was cut
    short by a kill during its write (or is being appended by a live run): it is left out, and
    `note(message)` says so. Any other line that is not a JSON object is an error naming it."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                if note is not None:
                    note(f"{path} line {number}: incomplete last row (a write cut short), left out")
                break
            raise ConfigError(f"{path} line {number}: not valid JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ConfigError(f"{path} line {number}: expected a JSON object with an integer 'step'")
        rows.append(row)
    return rows


class MetricsLog:
    """`wandb_project` turns W&B on (None: off); `run_config` is the run's config, shown by W&B; `log`
    says when resume leaves out a torn last row."""

    def __init__(self, run_dir: Path | None, tensorboard: bool = False, keep_until: int | None = None,
                 wandb_project: str | None = None, run_config: dict | None = None, log=print) -> None:
        self.path = run_dir / "metrics.jsonl" if run_dir is not None else None
        self.writer = self.wandb = None
        if tensorboard and run_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("log.tensorboard=true needs the tensorboard package (pip install tensorboard)") from exc
            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb_project is not None and run_dir is not None:
            self.wandb = _wandb_run(run_dir, wandb_project, run_config or {})
        self.rows: list[dict] = []
        if self.path is not None and keep_until is not None:
            self.rows = [r for r in read_metrics(self.path, log) if r["step"] <= keep_until]
            atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in self.rows).encode())
        elif self.path is not None:
            atomic_write_bytes(self.path, b"")

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, row["step"])
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(run_dir: Path, project: str, config: dict):
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("log.wandb=true needs the wandb package (pip install wandb)") from exc
    id_file = run_dir / "wandb_run.json"
    run_id = json.loads(id_file.read_text())["id"] if id_file.exists() else uuid.uuid4().hex[:8]
    atomic_write_json(id_file, {"id": run_id, "project": project})
    return wandb.init(project=project, id=run_id, resume="allow", name=run_dir.name, dir=str(run_dir), config=config)


def _width(fmt: str) -> int:
    return len(fmt.format(0) if "d" in fmt else fmt.format(0.0))


def table_header() -> str:
    return "  ".join(f"{header:>{_width(fmt)}}" for header, _, fmt in COLUMNS)


def table_row(row: dict) -> str:
    return "  ".join(fmt.format(row[key]) if row.get(key) is not None else f"{'-':>{_width(fmt)}}"
                     for _, key, fmt in COLUMNS)
