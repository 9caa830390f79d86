"""End to end: the same GRPO run with speculation off and with tlt, step by step, side by side.

Two trainers with the same config and seed but `speculative` (off vs adaptive with the default
drafter) run in one process and alternate step by step, so machine noise hits both alike. Each step's
time is split by stage (rollout / reward / logprob / update / sync / drafter); eval time is excluded
from step time. Ratios are off time / tlt time (> 1: tlt is faster): `ratios.speedup` over the whole
run and the median of per-step ratios, and the same for rollout alone. Because speculation is lossless,
both runs should learn alike; both reward and eval-accuracy curves go into the JSON (and a PNG), and
`accuracy_gain` is the tlt run's eval accuracy at the end minus at the start, in points.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=8, help="RL steps of each run")
    parser.add_argument("--config", help="YAML file of TrainConfig fields shared by both runs")
    parser.add_argument("--tlt", default="adaptive", help="speculative mode of the tlt run (adaptive or on)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", help="write config, per-step rows, curves and ratios here")
    parser.add_argument("--out", default="runs/bench/e2e", help="folder for the runs and the plot")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="TrainConfig fields shared by both runs")


def run(args: argparse.Namespace) -> int:
    import torch

    from tlt.config import build
    from tlt.io import atomic_write_json
    from tlt.rl.config import TrainConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    base = build(TrainConfig, args.config, [*args.overrides, f"steps={args.steps}"])
    result = compare(base, args.tlt, Path(args.out))
    if args.json:
        atomic_write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def compare(base, tlt_mode: str = "adaptive", out: Path | None = None, log=print) -> dict:
    """Run `base` with speculation off and with `tlt_mode`, alternating step by step; returns the result
    dict (ratios, breakdown, curves). With `out`, each run's config.json and metrics.jsonl go to
    out/off and out/tlt (the layout `tlt report` reads) and the comparison plot to out/e2e.png."""
    import dataclasses

    from tlt.config import to_dict
    from tlt.io import atomic_write_json
    from tlt.rl.metrics import MetricsLog
    from tlt.rl.trainer import GRPOTrainer

    steps = base.steps
    configs = {"off": dataclasses.replace(base, speculative="off"), "tlt": dataclasses.replace(base, speculative=tlt_mode)}
    trainers = {name: GRPOTrainer(c, log=lambda *_: None) for name, c in configs.items()}
    logs = {}
    for name, c in configs.items():
        if out is not None:
            atomic_write_json(out / name / "config.json", to_dict(c))
        logs[name] = MetricsLog(out / name if out is not None else None)
    rows: dict[str, list[dict]] = {name: [] for name in trainers}
    evals: dict[str, list[dict]] = {name: [] for name in trainers}
    every = base.eval_every or steps
    log(f"{base.model} model, {base.prompts_per_step} prompts x {base.group_size} samples, {steps} RL steps, "
        f"speculation off vs {tlt_mode}, alternating step by step")
    start = time.perf_counter()
    for name, trainer in trainers.items():
        evals[name].append({"step": 0, **trainer.evaluate()})
        logs[name].write(evals[name][-1])
    for step in range(1, steps + 1):
        for name, trainer in trainers.items():
            row = trainer.train_step()
            rows[name].append(row)
            if step % every == 0 or step == steps:
                evals[name].append({"step": step, **trainer.evaluate()})
                row = {**row, **evals[name][-1]}
            logs[name].write(row)
        off, on = rows["off"][-1], rows["tlt"][-1]
        log(f"step {step:3d}  off {off['time_step_s']:6.2f}s  tlt {on['time_step_s']:6.2f}s  "
            f"ratio {off['time_step_s'] / on['time_step_s']:5.2f}  reward off {off['reward']:.3f} tlt {on['reward']:.3f}"
            f"  accept {on['acceptance_length'] or 0:.2f}")
    for name, trainer in trainers.items():
        trainer.close()
        logs[name].close()

    def total(name, key):
        return sum(r[key] for r in rows[name])

    stages = ("rollout", "reward", "logprob", "update", "sync", "drafter")
    ratios = {
        "speedup": total("off", "time_step_s") / total("tlt", "time_step_s"),
        "speedup_median_step": statistics.median(a["time_step_s"] / b["time_step_s"]
                                                 for a, b in zip(rows["off"], rows["tlt"])),
        "rollout_speedup": total("off", "time_rollout_s") / total("tlt", "time_rollout_s"),
        "rollout_share_off": total("off", "time_rollout_s") / total("off", "time_step_s"),
    }
    first, last = evals["tlt"][0]["eval_accuracy"], evals["tlt"][-1]["eval_accuracy"]
    result = {
        "config": to_dict(base), "tlt_mode": tlt_mode, "steps": steps,
        "ratios": ratios,
        "accuracy_gain": 100.0 * (last - first),
        "accuracy_gain_off": 100.0 * (evals["off"][-1]["eval_accuracy"] - evals["off"][0]["eval_accuracy"]),
        "breakdown_s": {name: {s: total(name, f"time_{s}_s") for s in stages} for name in rows},
        "curves": {name: {"reward": [r["reward"] for r in rows[name]], "eval": evals[name],
                          "step_time_s": [r["time_step_s"] for r in rows[name]],
                          "acceptance_length": [r["acceptance_length"] for r in rows[name]]} for name in rows},
        "wall_s": time.perf_counter() - start,
    }
    log(f"speed-up (off time / tlt time): whole run {ratios['speedup']:.2f}, median step "
        f"{ratios['speedup_median_step']:.2f}, rollout {ratios['rollout_speedup']:.2f}; "
        f"rollout share of step time (off) {ratios['rollout_share_off']:.0%}")
    for name in rows:
        parts = "  ".join(f"{s} {result['breakdown_s'][name][s]:.1f}s" for s in stages)
        log(f"  {name:>3}: {parts}")
    log(f"eval accuracy: off {evals['off'][0]['eval_accuracy']:.3f} -> {evals['off'][-1]['eval_accuracy']:.3f}, "
        f"tlt {first:.3f} -> {last:.3f} ({result['accuracy_gain']:+.1f} points)")
    if out is not None:
        _plot(result, out / "e2e.png")
        log(f"wrote {out / 'e2e.png'}")
    return result


def _plot(result: dict, path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tlt.io import atomic_write_bytes

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in (("off", "-"), ("tlt", "--")):
        curve = result["curves"][name]
        steps = range(1, len(curve["reward"]) + 1)
        left.plot(steps, curve["reward"], style, label=f"{name}: train reward")
        left.plot([e["step"] for e in curve["eval"]], [e["eval_accuracy"] for e in curve["eval"]], style,
                  marker="o", label=f"{name}: eval accuracy")
        right.plot(steps, curve["step_time_s"], style, label=name)
    left.set(xlabel="RL step", ylabel="reward / accuracy", title="Learning: speculation off vs tlt")
    right.set(xlabel="RL step", ylabel="step time (s)",
              title=f"Step time (speed-up {result['ratios']['speedup']:.2f}x)")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
