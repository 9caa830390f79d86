"""`tlt demo`: the embedded default end to end on this machine.

Loads the default model and its tokenizer, samples a batch of fresh problems of the built-in task
(several samples each, as a GRPO rollout would), and reports accuracy and the response-length
distribution (the long tail tlt exists for), with a histogram PNG.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="model folder or built-in name")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="samples per problem (a GRPO group)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/demo", help="folder for the plot and the summary")


def run(args: argparse.Namespace) -> int:
    from tlt.evaluate import evaluate
    from tlt.model import load_model
    from tlt.io import atomic_write_json
    from tlt.plots import length_histogram
    from tlt.tasks import ArithmeticTask
    from tlt.tokenizer import load_tokenizer

    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    problems = ArithmeticTask().sample(args.problems, seed=args.seed, split="eval")
    print(f"tlt demo: {args.model} model, {args.problems} problems x {args.samples} samples, "
          f"temperature {args.temperature}")
    r = evaluate(model, tokenizer, problems, args.temperature, args.samples, seed=args.seed)
    lengths = r.length_summary()
    print(f"accuracy        {r.accuracy:.3f}  (pass@{args.samples} {r.pass_at_k:.3f})")
    print("by steps        " + "  ".join(f"{k}: {v:.2f}" for k, v in r.by_steps.items()))
    print(f"response length median {lengths['median']:g}  p90 {lengths['p90']:g}  p99 {lengths['p99']:g}  "
          f"max {lengths['max']}  (p99 / median = {lengths['p99'] / lengths['median']:.1f})")
    print(f"rollout         {r.samples} responses in {r.wall_time_s:.1f}s")
    out = Path(args.out)
    png = length_histogram(r.lengths, out / "response_lengths.png",
                           f"default model, {r.samples} responses at temperature {args.temperature}")
    atomic_write_json(out / "summary.json", {"accuracy": r.accuracy, "pass_at_k": r.pass_at_k,
                                             "by_steps": r.by_steps, "lengths": lengths, "samples": r.samples})
    print(f"wrote {png} and {out / 'summary.json'}")
    return 0
