"""Which operators a cached forward of `tlt bench roofline`'s random-large model spends its time in, by new tokens.

    python scripts/profile_forward_ops.py --tokens 1,9 --threads 2

prefills --prompt-len tokens, then times forwards of each T new tokens (rolled back after each) and prints
torch.profiler's table of aten operators over --steps of them (products on tlt's own kernels are calls into an
extension, not aten operators: the step time less the table's total is mostly theirs).
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tlt.bench.roofline import random_large


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,9")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", type=int, default=12, help="operators listed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = random_large(getattr(torch, args.dtype))
    with torch.inference_mode():
        cache = model.new_cache(1)
        model(torch.randint(3, 30000, (1, args.prompt_len)), cache=cache)

        def step(tokens: int) -> None:
            model(torch.randint(3, 30000, (1, tokens)), cache=cache)
            cache.rollback(args.prompt_len)

        for tokens in (int(t) for t in args.tokens.split(",")):
            for _ in range(3):
                step(tokens)
            start = time.perf_counter()
            for _ in range(args.steps):
                step(tokens)
            ms = (time.perf_counter() - start) / args.steps * 1e3
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    step(tokens)
            ops_ms = sum(e.self_cpu_time_total for e in prof.key_averages()) / args.steps / 1e3
            print(f"{tokens} new tokens: {ms:.1f} ms a step, {ops_ms:.1f} ms of it in aten operators")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
