"""A rollout's samples and time, to compare two checkouts of tlt (a refactor must keep both).

    PYTHONPATH=/path/to/checkout python scripts/rollout_fingerprint.py [--model default] [--prompts 16]

generates one GRPO-sized rollout (built-in task prompts x `--samples`, temperature 1.0, seeded) per
system (plain decoding, a fixed tree, the adaptive engine), each after an untimed warm-up rollout, and
prints one JSON line: per system the wall seconds, the tokens and a hash of every sample's token ids.
Only the public API is used, so the same file runs against older and newer checkouts. Run it
alternately from both checkouts, a few times each, and compare the hashes (they must be equal) and the
median of the paired time ratios (single pairs spread 0.6-1.4 on the project's shared 2-core machine)."""

from __future__ import annotations

import argparse
import hashlib
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--task", default="arithmetic")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=640)
    parser.add_argument("--strategy", default="tree-d4-k2-v8")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    import tlt
    from tlt.model.checkpoint import resolve_model_path
    from tlt.speculative import Drafter
    from tlt.tasks import get_task

    torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model)
    model = tlt.load_model(folder).eval()
    drafter = Drafter.load(args.drafter, model)
    tokenizer = tlt.load_tokenizer(folder)
    prompts = [tokenizer.encode(p.prompt) for p in get_task(args.task).sample(args.prompts, seed=0, split="eval")]
    params = tlt.SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    systems = {
        "off": tlt.EngineConfig(),
        args.strategy: tlt.EngineConfig(speculative="on", strategy=args.strategy, drafter=drafter),
        "adaptive": tlt.EngineConfig(speculative="adaptive", drafter=drafter),
    }
    result = {}
    for name, config in systems.items():
        engine = tlt.RolloutEngine(model, config=config)
        engine.generate(prompts[:2], params)  # warm-up; the adaptive tuner's first rollout
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
        ids = [c.token_ids for o in outputs for c in o.outputs]
        result[name] = {"wall_s": wall, "tokens": sum(map(len, ids)),
                        "samples_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
