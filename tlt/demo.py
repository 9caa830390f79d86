"""`tlt demo`: the embedded default end to end on this machine.

Loads the default model, its tokenizer and drafter, samples a batch of fresh problems of the built-in
task (several samples each, as a GRPO rollout would) and rolls it out with speculation off and with the
adaptive engine (the tuner picks each step's strategy by live batch size), the latter twice: with a
cold tuner, then with the tuner carried over, as between RL steps. Reports accuracy,
the response-length distribution (the long tail tlt exists for), the live batch profile and the
speed-up, and writes a histogram and a live-batch PNG.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="model folder or built-in name")
    parser.add_argument("--drafter", default="default", help="drafter folder or built-in name")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="samples per problem (a GRPO group)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/demo", help="folder for the plots and the summary")


def run(args: argparse.Namespace) -> int:
    from tlt.evaluate import evaluate
    from tlt.io import atomic_write_json
    from tlt.model import load_model
    from tlt.plots import length_histogram, live_batch
    from tlt.rollout import EngineConfig, RolloutEngine
    from tlt.speculative import Drafter
    from tlt.tasks import ArithmeticTask
    from tlt.tokenizer import load_tokenizer

    start = time.perf_counter()
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    drafter = Drafter.load(args.drafter, model)
    problems = ArithmeticTask().sample(args.problems, seed=args.seed, split="eval")
    print(f"tlt demo: {args.model} model ({model.config.num_hidden_layers} layers), {args.problems} problems x "
          f"{args.samples} samples, temperature {args.temperature}")
    results, profiles = {}, {}
    adaptive_engine = RolloutEngine(model, tokenizer, EngineConfig(speculative="adaptive", drafter=drafter))
    # The adaptive engine runs twice: first with a cold tuner (every arm of every bucket still untried),
    # then with the tuner it learned, as it is carried from one RL step's rollout to the next.
    for name, engine in (("off", RolloutEngine(model, tokenizer)), ("cold", adaptive_engine),
                         ("adaptive", adaptive_engine)):
        engine.reset_stats()
        results[name] = evaluate(model, tokenizer, problems, args.temperature, args.samples,
                                 seed=args.seed, engine=engine)
        stats = engine.stats()
        times, total = [], 0.0
        for t in stats["step_times_s"]:
            total += t
            times.append(total)
        profiles[name] = (times, stats["batch_sizes"])
        if name == "adaptive":
            accept = stats["acceptance_length"]
            used = {s: stats["strategies"].count(s) for s in sorted(set(stats["strategies"]))}
    off, cold, adaptive = results["off"], results["cold"], results["adaptive"]
    lengths = off.length_summary()
    print(f"accuracy        off {off.accuracy:.3f}   adaptive {adaptive.accuracy:.3f}   "
          f"(pass@{args.samples}: {off.pass_at_k:.3f} / {adaptive.pass_at_k:.3f})")
    print("by steps (off)  " + "  ".join(f"{k}: {v:.2f}" for k, v in off.by_steps.items()))
    print(f"response length median {lengths['median']:g}  p90 {lengths['p90']:g}  p99 {lengths['p99']:g}  "
          f"max {lengths['max']}  (p99 / median = {lengths['p99'] / lengths['median']:.1f})")
    print(f"rollout         off {off.wall_time_s:.1f}s   adaptive {adaptive.wall_time_s:.1f}s "
          f"(cold tuner {cold.wall_time_s:.1f}s)   speed-up {off.wall_time_s / adaptive.wall_time_s:.2f}x   "
          f"acceptance length {accept:.2f}")
    print("strategy steps  " + "  ".join(f"{k}: {v}" for k, v in used.items()))
    print("                (one run each: on a shared machine the times swing; `tlt bench rollout` gives medians)")
    out = Path(args.out)
    hist = length_histogram(off.lengths, out / "response_lengths.png",
                            f"default model, {off.samples} responses at temperature {args.temperature}")
    batch = live_batch(profiles, out / "live_batch.png", "live batch size during the rollout")
    atomic_write_json(out / "summary.json", {
        "accuracy": {"off": off.accuracy, "adaptive": adaptive.accuracy}, "pass_at_k": off.pass_at_k,
        "by_steps": off.by_steps, "lengths": lengths, "samples": off.samples,
        "rollout_s": {"off": off.wall_time_s, "adaptive": adaptive.wall_time_s, "adaptive_cold": cold.wall_time_s},
        "speedup": off.wall_time_s / adaptive.wall_time_s, "acceptance_length": accept, "strategy_steps": used,
    })
    print(f"wrote {hist}, {batch} and {out / 'summary.json'} ({time.perf_counter() - start:.0f}s in all)")
    return 0
