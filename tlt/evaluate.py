"""`tlt eval`: accuracy of a model on fresh problems of the built-in task, at a given temperature.

Problems come from the task's "eval" split (a stream separate from training data), so the figure is
on problems the SFT recipe did not draw from its stream. Reports overall accuracy, pass@k when more than
one sample per problem is drawn, accuracy by number of steps, and the response-length distribution.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from tlt.config import integer_flag, number_flag


@dataclass
class EvalResult:
    accuracy: float
    pass_at_k: float
    samples: int
    lengths: list[int]
    by_steps: dict[str, float]
    wall_time_s: float

    def length_summary(self) -> dict[str, float]:
        a = np.asarray(self.lengths)
        return {"median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
                "p99": float(np.percentile(a, 99)), "max": int(a.max()), "mean": float(a.mean())}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def evaluate(model, tokenizer, problems, temperature: float = 1.0, n: int = 1, max_tokens: int = 768,
             seed: int = 0, engine=None, progress: bool | None = None) -> EvalResult:
    from tlt.rollout import EngineConfig, RolloutEngine, SamplingParams
    from tlt.tasks import verify

    engine = engine or RolloutEngine(model, tokenizer, EngineConfig(progress=progress))
    params = [SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=seed * 100_003 + i)
              for i in range(len(problems))]
    stats_before = engine.rollout_stats.wall_time
    outputs = engine.generate([p.prompt for p in problems], params)
    correct, lengths, buckets, passes = [], [], {}, []
    for problem, out in zip(problems, outputs):
        hits = [verify(c.text, problem.answer) == 1.0 for c in out.outputs]
        correct += hits
        lengths += [len(c.token_ids) for c in out.outputs]
        passes.append(pass_at_k(n, sum(hits), n))
        key = _bucket(problem.num_steps)
        buckets.setdefault(key, []).extend(hits)
    order = sorted(buckets, key=_bucket_start)
    return EvalResult(
        accuracy=float(np.mean(correct)), pass_at_k=float(np.mean(passes)), samples=len(correct), lengths=lengths,
        by_steps={k: float(np.mean(buckets[k])) for k in order},
        wall_time_s=engine.rollout_stats.wall_time - stats_before,
    )


def _bucket_start(key: str) -> int:
    """The first step count of a `_bucket` key ("3-4" -> 3, "129+" -> 129), the order the keys print in."""
    return int(key.split("-")[0].rstrip("+"))


def _bucket(steps: int) -> str:
    for lo, hi in ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 128)):
        if lo <= steps <= hi:
            return f"{lo}-{hi}"
    return "129+"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.tasks import task_names

    parser.add_argument("--model", default="default", help="model folder or built-in name")
    parser.add_argument("--task", default="arithmetic", choices=task_names(),
                        help="the built-in task (or named task configuration) the problems come from")
    parser.add_argument("--problems", type=integer_flag(1), default=200)
    parser.add_argument("--samples", type=integer_flag(1), default=1, help="samples per problem (pass@k for k = samples)")
    parser.add_argument("--temperature", type=number_flag, default=1.0)
    parser.add_argument("--max-tokens", type=integer_flag(1), default=None,
                        help="response budget (default: 768, or the task's longest solution when longer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=integer_flag(0), default=0)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json", help="write the result here")


def run(args: argparse.Namespace) -> int:
    import torch

    from tlt.device import resolve_device
    from tlt.model import load_model
    from tlt.io import atomic_write_json
    from tlt.tasks import get_task
    from tlt.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device, "--device")
    model, tokenizer = load_model(args.model, device=device), load_tokenizer(args.model)
    task = get_task(args.task)
    max_tokens = args.max_tokens or max(768, task.config.max_solution_tokens)
    problems = task.sample(args.problems, seed=args.seed, split="eval")
    r = evaluate(model, tokenizer, problems, args.temperature, args.samples, max_tokens, args.seed)
    print(f"accuracy {r.accuracy:.3f} over {r.samples} samples of {len(problems)} problems "
          f"(temperature {args.temperature})" + (f", pass@{args.samples} {r.pass_at_k:.3f}" if args.samples > 1 else ""))
    print("by steps: " + "  ".join(f"{k}: {v:.2f}" for k, v in r.by_steps.items()))
    print("response length: " + "  ".join(f"{k} {v:g}" for k, v in r.length_summary().items()))
    if args.json:
        atomic_write_json(args.json, {"model": args.model, "task": args.task, "temperature": args.temperature, **r.__dict__,
                                      "length_summary": r.length_summary()})
    return 0
