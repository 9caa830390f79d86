"""GRPO runs of one config that differ in a few keys (speculation off and on, say), stepped in turn.

One process holds a trainer per run and alternates them step by step, so the machine's noise hits
every run alike and their step times compare. Each run evaluates at step 0, every `eval.every` steps
(none: only at the end) and at its last step; with `out` it writes out/<run>/config.json and
metrics.jsonl, the layout `tlt report` reads. `speedups` and `matching_steps` compare two runs' rows.
`tlt demo` and `tlt bench e2e` run on it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tlt.rl.config import TrainConfig


class SideBySide:
    """A trainer per named config; `rows` holds each run's training rows, `evals` its eval rows."""

    def __init__(self, configs: dict[str, TrainConfig], out: Path | None = None) -> None:
        from tlt.config import to_dict
        from tlt.io import atomic_write_json
        from tlt.rl.metrics import MetricsLog
        from tlt.rl.trainer import GRPOTrainer

        self.configs = configs
        self.trainers = {name: GRPOTrainer(c, log=lambda *_: None) for name, c in configs.items()}
        self.logs = {}
        for name, c in configs.items():
            if out is not None:
                atomic_write_json(out / name / "config.json", to_dict(c))
            self.logs[name] = MetricsLog(out / name if out is not None else None)
        self.rows: dict[str, list[dict]] = {name: [] for name in configs}
        self.evals: dict[str, list[dict]] = {name: [] for name in configs}

    def evaluate(self) -> None:
        """Every run's eval before its first step (step 0)."""
        for name, trainer in self.trainers.items():
            self.evals[name].append({"step": 0, **trainer.evaluate()})
            self.logs[name].write(self.evals[name][-1])

    def step(self) -> dict[str, dict]:
        """One RL step of every run in turn, each with its eval when due; returns each run's row (in config
        order). The order rotates by one each step (as the benches' repeats do, `tlt.bench.rotation`), so no run
        always goes first or follows the same one while the machine's speed drifts: with a fixed order the GRPO
        e2e bench measured tlt over frozen step time 1.055 stepping off, tlt, frozen and 1.025 stepping off,
        frozen, tlt (one run each, docs/results/bench_e2e_ucb*.json)."""
        from tlt.bench import rotation

        for name in rotation(list(self.trainers), len(next(iter(self.rows.values())))):
            trainer = self.trainers[name]
            row = trainer.train_step()
            self.rows[name].append(row)
            c = self.configs[name]
            if trainer.step % (c.eval.every or c.steps) == 0 or trainer.step == c.steps:
                self.evals[name].append({"step": trainer.step, **trainer.evaluate()})
                row = {**row, **self.evals[name][-1]}
            self.logs[name].write(row)
        return {name: rows[-1] for name, rows in self.rows.items()}

    def close(self) -> None:
        for name, trainer in self.trainers.items():
            trainer.close()
            self.logs[name].close()


def total(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows)


def speedups(off: list[dict], on: list[dict]) -> dict[str, float]:
    """Off time / on time of two runs' rows (> 1: `on` is faster), eval excluded: whole steps (over the
    run and the median per-step ratio) and rollouts; the rollout's share of an off step, and the
    whole-step speed-up the rollout speed-up alone can give at that share (Amdahl)."""
    out = {
        "speedup": total(off, "time_step_s") / total(on, "time_step_s"),
        "speedup_median_step": statistics.median(a["time_step_s"] / b["time_step_s"] for a, b in zip(off, on)),
        "rollout_speedup": total(off, "time_rollout_s") / total(on, "time_rollout_s"),
        "rollout_share": total(off, "time_rollout_s") / total(off, "time_step_s"),
    }
    s, r = out["rollout_share"], out["rollout_speedup"]
    out["amdahl_bound"] = 1.0 / ((1.0 - s) + s / r)
    return out


def matching_steps(a: list[dict], b: list[dict]) -> int:
    """How many steps, from the first, two runs' rows agree in every response length and the mean
    reward: with target-only verification (the default arms) a tlt run draws the plain run's very
    samples, so the runs agree until a rounding difference flips a draw (or for ever)."""
    n = 0
    for x, y in zip(a, b):
        if x["response_lengths"] != y["response_lengths"] or x["reward"] != y["reward"]:
            break
        n += 1
    return n
