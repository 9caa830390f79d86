"""Which drafter suits a policy: paired acceptance lengths of several drafters on held-out prompts.

    python scripts/compare_drafters.py tlt/assets/default/drafter tlt/assets/default/drafter-references
    python scripts/compare_drafters.py --model path/to/hf-model --strategies tree-d4-k2-v8 D1 D2 --json cmp.json

Each drafter drafts for the built-in task's eval prompts under each target-only strategy (trees and
n-gram drafts verify every token with plain sampling's own uniform), so every run draws the same
responses and the acceptance lengths are paired: their ratio is the drafter's, not the samples'.
The script checks that, and fails if two runs of one strategy drew different tokens.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", help="drafter folders (or 'default')")
    parser.add_argument("--model", default="default", help="target model folder or built-in name")
    parser.add_argument("--task", default="arithmetic", help="built-in task (or named configuration, e.g. bench) "
                        "whose eval prompts are drafted for")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the target's dtype (auto: the one its config.json names, else float32)")
    parser.add_argument("--strategies", default="tree-d4-k2-v8,tree-d4-k4-v16", help="target-only strategies")
    parser.add_argument("--prompts", type=int, default=64, help="eval-split problems")
    parser.add_argument("--samples", type=int, default=4, help="samples per problem")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=640)
    parser.add_argument("--seed", type=int, default=11, help="picks the problems and the samples")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args(argv)

    import torch

    from tlt.bench import comma_list
    from tlt.model import load_model
    from tlt.speculative import Drafter
    from tlt.speculative.train import check_target_only, held_out_acceptance
    from tlt.tasks import get_task
    from tlt.tokenizer import load_tokenizer

    strategies = comma_list(args.strategies)
    for s in strategies:
        check_target_only(s, "--strategies")
    torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.model, dtype=args.dtype), load_tokenizer(args.model)
    prompts = [p.prompt for p in get_task(args.task).sample(args.prompts, seed=args.seed, split="eval")]
    rows, drawn = [], {}
    for name in args.drafters:
        drafter = Drafter.load(name, target)
        row = {"drafter": name}
        for s in strategies:
            length, ids = held_out_acceptance(drafter, tokenizer, prompts, args.samples, args.temperature,
                                              args.max_tokens, args.seed, s)
            if drawn.setdefault(s, ids) != ids:
                raise SystemExit(f"{name} under {s} drew other tokens than {args.drafters[0]}: not paired")
            row[s] = round(length, 4)
        rows.append(row)
        print("  ".join([f"{name:50s}"] + [f"{s} {row[s]:.3f}" for s in strategies]), flush=True)
    tokens = {s: sum(len(t) for t in ids) for s, ids in drawn.items()}
    print("tokens per run: " + ", ".join(f"{s} {n}" for s, n in tokens.items()))
    if args.json:
        from tlt.io import atomic_write_json

        atomic_write_json(args.json, {"config": vars(args), "tokens": tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
