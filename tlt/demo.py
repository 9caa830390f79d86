"""`tlt demo`: the embedded default end to end on this machine: a short GRPO run, tlt against off.

Two GRPO runs of the default model on the built-in task share one config and seed and differ only in
speculation: off, and tlt's adaptive engine with the default drafter. They alternate step by step
(`tlt.rl.side_by_side`), so both see the same machine. The demo prints each step's time for both and
the tlt run's step table, then the end-to-end speed-up (off step time / tlt step time, eval excluded),
both runs' eval accuracy at the start and the end, how many steps drew the very same samples in both
runs (all of them, with the default target-only arms, barring a rounding flip), and writes `tlt report`
plots for the tlt run compared with the off run.
A few steps are too few for learning to show and for a stable speed figure: `tlt bench e2e` and
`tlt train` are the tools for those.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tlt.config import integer_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=integer_flag(1), default=6, help="RL steps of each run")
    parser.add_argument("--out", default="runs/demo", help="folder for both runs, the plots and the report")
    parser.add_argument("--threads", type=integer_flag(0), default=0)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="TrainConfig fields shared by both runs")


def run(args: argparse.Namespace) -> int:
    import shutil

    import torch

    from tlt.config import build, override
    from tlt.rl.config import TrainConfig
    from tlt.rl.metrics import read_metrics, table_header, table_row
    from tlt.rl.side_by_side import SideBySide, matching_steps, speedups
    from tlt.report import write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    defaults = ["prompts_per_step=8", "group_size=8", "eval.problems=32", "eval.samples=4", f"steps={args.steps}",
                f"eval.every={args.steps}"]
    config = build(TrainConfig, None, [*defaults, *args.overrides])
    out = Path(args.out)
    for name in ("off", "tlt"):
        shutil.rmtree(out / name, ignore_errors=True)
    print("tlt demo: a short GRPO run, speculation off and tlt side by side")
    print(f"{config.model} model, {config.prompts_per_step} prompts x {config.group_size} samples, "
          f"{config.steps} RL steps, alternating step by step")
    runs = SideBySide({"off": override(config, {"speculative": "off"}),
                       "tlt": override(config, {"speculative": "adaptive"})}, out)
    try:
        runs.evaluate()
        for step in range(1, config.steps + 1):
            rows = runs.step()
            print(f"step {step:3d}  " + "  ".join(f"{name} {r['time_step_s']:6.2f}s reward {r['reward']:.3f}"
                                                  for name, r in rows.items())
                  + f"  accept tlt {rows['tlt']['acceptance_length'] or 0:.2f}")
    finally:
        runs.close()
    print("\ntlt run, step by step:")
    print(table_header())
    for row in read_metrics(out / "tlt" / "metrics.jsonl"):
        print(table_row(row))
    report = write_report(out / "tlt", compare=out / "off", labels=("tlt", "off"))
    ratios = speedups(runs.rows["off"], runs.rows["tlt"])
    print(f"\nend-to-end speed-up over speculation off: {ratios['speedup']:.2f}x per RL step "
          f"(rollout {ratios['rollout_speedup']:.2f}x; rollout is {ratios['rollout_share']:.0%} of an off step)")
    print("(one short run on a shared machine: `tlt bench e2e --steps 20` gives a steadier figure)")
    print("eval accuracy, start -> end: " + ", ".join(f"{name} {e[0]['eval_accuracy']:.3f} -> {e[-1]['eval_accuracy']:.3f}"
                                                      for name, e in runs.evals.items()))
    print(f"same samples as the off run (every response length and the reward) in "
          f"{matching_steps(runs.rows['off'], runs.rows['tlt'])} of {config.steps} steps: tlt's default arms verify "
          "target-only, so the two are the same run")
    print(f"wrote {report} and its plots ({time.perf_counter() - start:.0f}s in all)")
    return 0
