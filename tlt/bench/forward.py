"""Prefill throughput and one-token decode latency of tlt's model against transformers' on the same weights.

Both models are loaded from one folder. For each batch size B, with prompts of P random tokens:
  - prefill: one forward over [B, P] into an empty cache (tlt: `model.new_cache(B)`; transformers:
    `use_cache=True`), logits at every position; reported as tokens/s = B * P / seconds;
  - decode: one forward over [B, 1] after a cache holding P tokens, reported in ms. The cache length is
    the same for every timed step: tlt's cache is rolled back to P before each step, transformers'
    DynamicCache is a `copy.deepcopy` of the prefilled one; both outside the timed region.
Each measurement is warmed up once, then repeated; tlt and transformers alternate (and swap which goes
first every repeat) so machine noise hits both. Reported values are medians over repeats; a ratio is the
median of the per-repeat paired ratios, > 1 meaning tlt is faster. The largest logit difference of the
two prefills is recorded as a check that the two really run the same model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# Shape of the random stand-in, similar to the built-in default model.
RANDOM_MODEL = dict(
    hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    intermediate_size=512, vocab_size=32, max_position_embeddings=4096,
)

# The four timed steps of one repeat; odd repeats run them in ORDER, even ones (the warm-up too) SWAPPED.
ORDER = ("tlt_prefill", "hf_prefill", "tlt_decode", "hf_decode")
SWAPPED = ("hf_prefill", "tlt_prefill", "hf_decode", "tlt_decode")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_ints(text: str) -> list[int]:
    return [_positive_int(v) for v in text.split(",")]


def _all_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model folder or built-in name (default: 'default' if shipped, "
                                        "else a random Qwen3 model of similar shape)")
    parser.add_argument("--batch-sizes", type=_positive_ints, default=[1, 8, 64], metavar="B,B,...")
    parser.add_argument("--prompt-len", type=_positive_int, default=128)
    parser.add_argument("--repeats", type=_positive_int, default=5)
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")


def random_model_folder(directory: Path, seed: int = 0) -> Path:
    """Save a randomly initialised transformers Qwen3 model of shape `RANDOM_MODEL` into `directory`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**RANDOM_MODEL, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(directory)
    return Path(directory)


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> tuple[float, Any]:
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def _paired_median(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def measure(
    folder: str | os.PathLike,
    batch_sizes: list[int],
    prompt_len: int = 128,
    repeats: int = 5,
    dtype: str = "float32",
    device: str = "cpu",
    command: list[str] | None = None,
) -> dict[str, Any]:
    """Run the benchmark on the model in `folder`; returns the JSON record: `config`, `rows`, `ratios`."""
    import copy
    import inspect
    import shlex

    import torch

    import tlt
    from tlt.errors import ConfigError, TltError

    from tlt.model.checkpoint import resolve_model_path

    folder = resolve_model_path(folder)  # a built-in name becomes its folder, which transformers reads too
    model = tlt.load_model(folder, dtype=dtype, device=device)
    if prompt_len + 1 > model.config.max_position_embeddings:
        raise ConfigError(f"--prompt-len {prompt_len} leaves no room in max_position_embeddings "
                          f"({model.config.max_position_embeddings})")
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise TltError(f"the forward benchmark needs transformers ({exc}); install tlt[hf]") from None
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    hf = hf.to(device).eval()
    # transformers renamed `past_key_values` to `cache` during 5.x; use whichever this version takes.
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    rows = []
    with torch.inference_mode():
        for B in batch_sizes:
            ids = torch.randint(vocab, (B, prompt_len), generator=gen).to(device)
            next_ids = torch.randint(vocab, (B, 1), generator=gen).to(device)

            def tlt_prefill():
                return model(ids, cache=model.new_cache(B)).logits

            def hf_prefill():
                return hf(ids, use_cache=True).logits

            cache = model.new_cache(B)
            model(ids, cache=cache)
            hf_prefilled = getattr(hf(ids, use_cache=True), cache_arg)

            def tlt_decode():
                return model(next_ids, cache=cache).logits

            def hf_decode(past):
                return hf(next_ids, use_cache=True, **{cache_arg: past}).logits

            samples: dict[str, list[float]] = {name: [] for name in ORDER}
            for r in range(repeats + 1):  # repeat 0 is the warm-up
                cache.rollback(prompt_len)
                past = copy.deepcopy(hf_prefilled)
                steps = {"tlt_prefill": tlt_prefill, "hf_prefill": hf_prefill,
                         "tlt_decode": tlt_decode, "hf_decode": lambda: hf_decode(past)}
                order = ORDER if r % 2 else SWAPPED
                results = {name: _timed(steps[name], sync) for name in order}
                if r == 0:
                    logit_diff = float((results["tlt_prefill"][1].float() - results["hf_prefill"][1].float()).abs().max())
                    continue
                for name, (seconds, _) in results.items():
                    samples[name].append(seconds)

            tokens = B * prompt_len
            rows.append({
                "batch": B,
                "tlt_prefill_tok_s": tokens / statistics.median(samples["tlt_prefill"]),
                "hf_prefill_tok_s": tokens / statistics.median(samples["hf_prefill"]),
                "prefill_vs_hf": _paired_median(samples["hf_prefill"], samples["tlt_prefill"]),
                "tlt_decode_ms": 1e3 * statistics.median(samples["tlt_decode"]),
                "hf_decode_ms": 1e3 * statistics.median(samples["hf_decode"]),
                "decode_vs_hf": _paired_median(samples["hf_decode"], samples["tlt_decode"]),
                "prefill_max_abs_logit_diff": logit_diff,
                "seconds": samples,
            })

    config = {
        "command": shlex.join(command if command is not None else sys.argv),
        "model": str(folder),
        "architecture": model.config.architecture,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch_sizes": list(batch_sizes),
        "prompt_len": prompt_len,
        "repeats": repeats,
        "dtype": dtype,
        "device": device,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_attention": "sdpa",
    }
    ratios = {
        "prefill_vs_hf": {str(row["batch"]): row["prefill_vs_hf"] for row in rows},
        "decode_vs_hf": {str(row["batch"]): row["decode_vs_hf"] for row in rows},
    }
    return {"config": config, "rows": rows, "ratios": ratios}


def format_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'batch':>5}  {'tlt prefill tok/s':>17}  {'hf prefill tok/s':>16}  {'ratio':>5}  " \
             f"{'tlt decode ms':>13}  {'hf decode ms':>12}  {'ratio':>5}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['batch']:>5}  {r['tlt_prefill_tok_s']:>17,.0f}  {r['hf_prefill_tok_s']:>16,.0f}  "
            f"{r['prefill_vs_hf']:>5.2f}  {r['tlt_decode_ms']:>13.2f}  {r['hf_decode_ms']:>12.2f}  {r['decode_vs_hf']:>5.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from tlt.io import atomic_write_json
    from tlt.model.checkpoint import BUILTIN_MODELS

    torch.set_num_threads(args.threads or _all_cores())
    with tempfile.TemporaryDirectory(prefix="tlt-bench-forward-") as scratch:
        model = label = args.model
        if model is None and (BUILTIN_MODELS["default"] / "config.json").is_file():
            model = label = "default"
        if model is None:
            model = random_model_folder(Path(scratch) / "random-qwen3")
            label = "random Qwen3 (" + ", ".join(f"{k}={v}" for k, v in RANDOM_MODEL.items()) + ")"
            print(f"no built-in default model shipped; benchmarking a {label}")
        record = measure(model, args.batch_sizes, args.prompt_len, args.repeats, args.dtype, args.device)
    record["config"]["model"] = label
    c = record["config"]
    print(f"model {c['model']} ({c['architecture']}, {c['parameters']:,} parameters), prompt {c['prompt_len']} tokens, "
          f"{c['dtype']} on {c['device']}, threads={c['threads']}, median of {c['repeats']} repeats")
    print(format_table(record["rows"]))
    print("ratio: hf time / tlt time, median of the per-repeat pairs (> 1: tlt faster)")
    worst = max(row["prefill_max_abs_logit_diff"] for row in record["rows"])
    print(f"max |logit difference| tlt vs transformers on the prefills: {worst:.2e}")
    if args.json is not None:
        atomic_write_json(args.json, record)
        print(f"wrote {args.json}")
    return 0
