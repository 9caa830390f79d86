"""The cost of one training forward and backward of a `tlt sft` preset's model, in float32 and under bf16 autocast.

    python scripts/train_step_cost.py [--preset bench] [--tokens 256] [--repeats 3] [--threads 2]

builds the preset's model with random weights (the shape is what costs), times a forward and backward over one
row of `--tokens` tokens in each mode, alternating, after one untimed pass each, and prints one JSON line: the
medians, their ratio and whether this CPU has bf16 products (`tlt.device.slow_cpu_bf16`). On a CPU whose oneDNN has
no bf16 (AVX2 only) autocast takes PyTorch's reference kernels, which is why `tlt sft` trains in float32 there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from tlt.device import slow_cpu_bf16
    from tlt.model import Transformer
    from tlt.sft import config_from, model_config
    from tlt.tasks import CharTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = CharTokenizer()
    model = Transformer(model_config(config_from(args.preset), tokenizer)).train()
    ids = torch.randint(3, tokenizer.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    def step(autocast: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits
        logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    times = {False: [], True: []}
    for mode in times:
        step(mode)  # warm-up
    for _ in range(args.repeats):
        for mode in times:
            times[mode].append(step(mode))
    float32, autocast = (statistics.median(times[mode]) for mode in (False, True))
    print(json.dumps({"preset": args.preset, "tokens": args.tokens, "threads": args.threads,
                      "float32_s": round(float32, 3), "bf16_autocast_s": round(autocast, 3),
                      "autocast_over_float32": round(autocast / float32, 2), "slow_cpu_bf16": slow_cpu_bf16()}))


if __name__ == "__main__":
    main()
