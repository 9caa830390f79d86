"""Speculative decoding by batch size: every strategy against plain decoding, and transformers' assisted generation.

The workload is a built-in task (`--task`; the bench policy's own for `--model bench`) at temperature 1.0: a run at batch b generates `--prompts` distinct
eval-split prompts (at least b), one sample each, as consecutive batches of b, every response running
to its end-of-sequence token, so the live batch of each starts at b and shrinks. Covering several
prompts keeps a small batch's figure from resting on one short response. For each batch size every strategy (`off` is plain decoding) runs on the same prompts with
the same per-request seeds, each run in a fresh engine; within a repeat the strategies alternate, and
the order rotates every repeat, so machine noise hits all of them. Each figure is the median of
`--repeats` runs (one short untimed warm-up per system first). speedup_vs_off is a strategy's median
tokens/s over that of `off` at the same batch size (> 1: faster); paired_vs_off is the median over
repeats of that ratio within a repeat, steadier when the machine's speed drifts between repeats.
acceptance_length is tokens per row per speculative step (accepted drafts + 1). `--dtype` sets the
weights' dtype of every system (tlt's target and drafter, transformers' model and assistant): bfloat16
is what GPU rollouts run; on a CPU its products of a few rows cost more than float32's and of many rows
less, so it moves the ratios. `--baseline-dtype D` adds plain decoding with weights in D (`off_D`) at
every batch size, and each row's `speedup_vs_off_D` / `paired_vs_off_D` over it. `--drafter-bits 16,4`
runs every drafting strategy with the drafter's weights as they are and rounded to 4 bits
(`EngineConfig.drafter_bits`; systems named `STRATEGY:q4`), side by side.

At batch 1 transformers runs too: plain `generate` ("hf") and assisted generation with sampling
("hf-assisted-2layer", speculative sampling against a draft model). The default model has no smaller
sibling, so the assistant is the target truncated to its first 2 decoder layers (its embedding, those
layers, the final norm and the LM head, copied unchanged) and saved as a checkpoint transformers
loads; this is the layer-skip style of drafting, not a trained draft model. Its acceptance_length is
tokens per target forward. If assisted generation fails, the row records the error instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tlt.bench import (add_workload_arguments, baseline_name, comma_list, engine_config, fill_workload_defaults, paired,
                       parse_drafter_window, rotation)
from tlt.bench.forward import _positive_int, _positive_ints
from tlt.bench.rollout import summarize
from tlt.device import synchronize
from tlt.model.checkpoint import DTYPE_NAMES

STRATEGIES = ("off", "chain-d4", "tree-d6-k4-v24", "tree-d8-k4-v48", "ngram-d4")
ASSISTANT_LAYERS = 2
HF = "hf"
HF_ASSISTED = f"hf-assisted-{ASSISTANT_LAYERS}layer"
WARMUP_TOKENS = 32
ASSISTANT = (f"the target's first {ASSISTANT_LAYERS} decoder layers with its embedding, final norm and LM head "
             "(no separate small model exists)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="model folder or built-in name")
    add_workload_arguments(parser)
    parser.add_argument("--batch-sizes", type=_positive_ints, default=[1, 4, 16, 64], metavar="B,B,...")
    parser.add_argument("--strategies", type=comma_list, default=list(STRATEGIES), metavar="S,S,...",
                        help="strategy names; 'off' (plain decoding) is the baseline and must be included")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=_positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="picks the prompts")
    parser.add_argument("--prompts", type=_positive_int, default=8,
                        help="prompts per run at each batch size (at least the batch size), as consecutive batches")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto: cuda when torch sees one)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                        help="the weights' dtype for every system, tlt's and transformers' alike")
    parser.add_argument("--baseline-dtype", choices=DTYPE_NAMES, default=None,
                        help="also run plain decoding with weights in this dtype (`off_<dtype>`, at every batch size)")
    parser.add_argument("--drafter-bits", type=_positive_ints, default=[16], metavar="BITS,...",
                        help="drafter weights: 16 (as they are), 4 (rounded, the system STRATEGY:q4), or both")
    parser.add_argument("--drafter-window", default="auto", metavar="W",
                        help="the drafter's attention keeps each row's newest W pairs (EngineConfig.drafter_window; "
                             "0: the whole context; auto, the default: a quarter of the window the drafter was trained over)")
    parser.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write config, rows and ratios here")


# --- systems: each run returns {"wall_s", "tokens", "acceptance_length"} ------------------------------
def batches_of(prompts: list, b: int, total: int) -> list[list]:
    """The first max(b, total) prompts (rounded up to whole batches) as consecutive batches of b."""
    return [prompts[i : i + b] for i in range(0, covered(b, total), b)]


def covered(b: int, total: int) -> int:
    return -(-max(b, total) // b) * b


def run_engine(model, drafter, batches: list[list[list[int]]], strategy: str, temperature: float, max_tokens: int,
               repeat: int, drafter_bits: int = 16, drafter_window: int | str | None = None) -> dict:
    from tlt.rollout import RolloutEngine, SamplingParams

    engine = RolloutEngine(model, config=engine_config(strategy, drafter, progress=False, drafter_bits=drafter_bits,
                                                       drafter_window=drafter_window))
    wall = tokens = 0
    for k, prompts in enumerate(batches):
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=(repeat + 1) * 1000 + k * len(prompts) + i)
                  for i in range(len(prompts))]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        wall += time.perf_counter() - start
        tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"wall_s": wall, "tokens": tokens, "acceptance_length": engine.rollout_stats.acceptance_length()}


def run_hf(hf_model, batches: list[list[list[int]]], temperature: float, max_tokens: int, eos_id: int, pad_id: int,
           repeat: int, assistant=None) -> dict:
    """One `generate` per prompt (batch 1: no padding); with `assistant`, assisted generation."""
    import torch

    forwards = []
    hook = hf_model.register_forward_hook(lambda *_: forwards.append(1))
    extra = {"assistant_model": assistant} if assistant is not None else {}
    wall = tokens = 0
    try:
        for k, (prompt,) in enumerate(batches):
            ids = torch.tensor([prompt], device=hf_model.device)
            torch.manual_seed((repeat + 1) * 1000 + k)
            start = time.perf_counter()
            out = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=temperature > 0, temperature=temperature or None,
                top_k=0, top_p=1.0, max_new_tokens=max_tokens, eos_token_id=eos_id, pad_token_id=pad_id, **extra,
            )
            synchronize(hf_model.device)
            wall += time.perf_counter() - start
            new = out[0, len(prompt):].tolist()
            tokens += new.index(eos_id) + 1 if eos_id in new else len(new)
    finally:
        hook.remove()
    return {"wall_s": wall, "tokens": tokens,
            "acceptance_length": tokens / len(forwards) if assistant is not None and forwards else None}


def truncated_copy(model, layers: int, directory: Path) -> Path:
    """Save the target's embedding, first `layers` decoder layers, final norm and LM head as a model."""
    from tlt.model import Transformer

    c = model.config
    extra = {k: (v[:layers] if k == "layer_types" else v) for k, v in c.extra.items()}
    small = Transformer(c.replace(num_hidden_layers=layers, extra=extra))
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    small.load_state_dict(state)
    small.save_pretrained(directory)
    return directory


# --- measurement ---------------------------------------------------------------------------------------
def measure(
    model_path: str | Path,
    drafter_path: str | Path = "default",
    batch_sizes: list[int] = (1, 4, 16, 64),
    strategies: list[str] = STRATEGIES,
    temperature: float = 1.0,
    max_tokens: int = 640,
    repeats: int = 3,
    seed: int = 0,
    skip_hf: bool = False,
    prompts_per_run: int = 8,
    device: str = "cpu",
    dtype: str = "float32",
    baseline_dtype: str | None = None,
    task: str = "arithmetic",
    command: list[str] | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
    drafter_bits: list[int] = (16,),
    drafter_window: int | str | None = "auto",
) -> dict[str, Any]:
    """Run the benchmark; returns the JSON record: `config`, `rows`, `ratios`."""
    import shlex
    import tempfile

    import torch
    import transformers

    from tlt.errors import ConfigError
    from tlt.model import load_model
    from tlt.model.checkpoint import resolve_model_path
    from tlt.rollout import EngineConfig
    from tlt.speculative import Drafter, Strategy
    from tlt.speculative.decoder import window_for
    from tlt.tasks import get_task
    from tlt.tokenizer import load_tokenizer

    strategies = [Strategy.parse(s).name for s in strategies]
    if "off" not in strategies:
        raise ConfigError("--strategies must include 'off', the baseline of speedup_vs_off")
    folder = resolve_model_path(model_path)
    from tlt.device import resolve_device

    device = resolve_device(device, "--device")
    model, tokenizer = load_model(folder, dtype=dtype, device=device), load_tokenizer(folder)
    if not drafter_bits or any(b not in (4, 16) for b in drafter_bits) or len(set(drafter_bits)) < len(drafter_bits):
        raise ConfigError(f"--drafter-bits must list 16 and/or 4 once each, got {list(drafter_bits)}")
    try:
        EngineConfig(drafter_window=drafter_window)  # refused here, before anything runs
    except ConfigError as exc:
        raise ConfigError(f"--drafter-window: {exc}") from None
    needs_drafter = any(Strategy.parse(s).uses_drafter for s in strategies)
    # one drafter per width, so no run rebuilds the other's prepared weights inside its timing
    drafters = {bits: Drafter.load(drafter_path, model) for bits in drafter_bits} if needs_drafter else {}
    problems = get_task(task).sample(max(covered(b, prompts_per_run) for b in batch_sizes), seed=seed, split="eval")
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def engine_system(strategy: str, target=model, bits: int = 16):
        return lambda batch, n, r: run_engine(target, drafters.get(bits), batch, strategy, temperature, n, r, bits,
                                              drafter_window)

    systems = {}
    for s in strategies:  # strategies without the learned drafter run once, under their own name
        widths = drafter_bits if Strategy.parse(s).uses_drafter else [16]
        systems.update({s if bits == 16 else f"{s}:q{bits}": engine_system(s, bits=bits) for bits in widths})
    baseline = baseline_name(baseline_dtype, dtype)
    if baseline is not None:
        systems[baseline] = engine_system("off", load_model(folder, dtype=baseline_dtype, device=device))
    hf_systems, errors = {}, {}
    scratch = tempfile.TemporaryDirectory(prefix="tlt-bench-speculative-")
    with scratch, torch.inference_mode():
        if not skip_hf:
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=model.dtype).to(device).eval()
            hf_systems[HF] = lambda batch, n, r: run_hf(hf_model, batch, temperature, n, eos, pad, r)
            try:
                small = truncated_copy(model, ASSISTANT_LAYERS, Path(scratch.name) / "assistant")
                assistant = AutoModelForCausalLM.from_pretrained(str(small), dtype=model.dtype).to(device).eval()
                hf_systems[HF_ASSISTED] = lambda batch, n, r: run_hf(hf_model, batch, temperature, n, eos, pad,
                                                                     r, assistant)
            except Exception as exc:  # transformers' assisted generation is not ours to debug here
                errors[HF_ASSISTED] = f"{type(exc).__name__}: {exc}"

        def attempt(name: str, fn, batch, n: int, r: int) -> dict | None:
            if name in errors:
                return None
            if name != HF_ASSISTED:
                return fn(batch, n, r)
            try:
                return fn(batch, n, r)
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                log(f"  {name} failed: {errors[name]}")
                return None

        plan = {b: dict(systems) for b in batch_sizes}
        if hf_systems:
            plan.setdefault(1, {}).update(hf_systems)
        warm = [prompts[: min(batch_sizes)]]
        for name, fn in {**systems, **hf_systems}.items():  # warm-up, not timed
            attempt(name, fn, warm, min(max_tokens, WARMUP_TOKENS), -1)
        log(f"speculative bench: {dtype}, batch sizes {list(batch_sizes)}, temperature {temperature}, max {max_tokens} tokens, "
            f"{torch.get_num_threads()} threads, median of {repeats}")
        results: dict[tuple[int, str], list[dict]] = {}
        for b, here in plan.items():
            for r in range(repeats):
                for name in rotation(list(here), r):
                    out = attempt(name, here[name], batches_of(prompts, b, prompts_per_run), max_tokens, r)
                    if out is not None:
                        results.setdefault((b, name), []).append(out)
                        log(f"  batch {b:3d} run {r + 1}: {name:20s} {out['wall_s']:7.2f}s {out['tokens']:6d} tokens")

    rows = make_rows(results, errors, baseline)
    config = {
        "command": shlex.join(command if command is not None else sys.argv),
        "model": str(model_path), "task": task, "drafter": str(drafter_path) if needs_drafter else None,
        "batch_sizes": list(batch_sizes), "strategies": strategies, "temperature": temperature,
        "max_tokens": max_tokens, "repeats": repeats, "seed": seed, "prompts_per_run": prompts_per_run, "skip_hf": skip_hf,
        "drafter_bits": list(drafter_bits),
        "drafter_window": drafter_window,
        "drafter_window_applied": window_for(drafter_window, next(iter(drafters.values()), None)),
        "threads": torch.get_num_threads(), "device": str(device), "dtype": dtype, "baseline_dtype": baseline_dtype,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "hf_assistant": None if skip_hf else ASSISTANT,
    }
    names = [name for name in systems if name != baseline]  # the strategies, with their :q4 variants
    return {"config": config, "rows": rows, "ratios": make_ratios(rows, names, baseline)}


def make_rows(results: dict[tuple[int, str], list[dict]], errors: dict[str, str], baseline: str | None = None) -> list[dict]:
    """One row per (batch, system), with speedup_vs_off and paired_vs_off against plain decoding at the
    same batch size, and with `baseline` (a plain-decoding system in another dtype) the same two against
    it: speedup_vs_<baseline>, paired_vs_<baseline>."""
    rows = []
    for (b, name), runs in results.items():
        row = {"batch": b, "strategy": name, **summarize(runs)}
        accepted = [r["acceptance_length"] for r in runs if r["acceptance_length"] is not None]
        row["acceptance_length"] = statistics.median(accepted) if accepted else None
        rows.append(row)
    for name, error in errors.items():
        rows.append({"batch": 1, "strategy": name, "error": error, "wall_s": None, "tokens": None,
                     "tokens_per_s": None, "acceptance_length": None})
    references = ["off"] + ([baseline] if baseline is not None else [])
    speed = {ref: {r["batch"]: r["tokens_per_s"] for r in rows if r["strategy"] == ref} for ref in references}
    for row in rows:
        if row["strategy"] == HF_ASSISTED:
            row["assistant"] = ASSISTANT
        runs = results.get((row["batch"], row["strategy"]))
        for ref in references:
            base = speed[ref].get(row["batch"])
            row[f"speedup_vs_{ref}"] = row["tokens_per_s"] / base if row["tokens_per_s"] is not None and base else None
            row[f"paired_vs_{ref}"] = paired(runs, results.get((row["batch"], ref)))
    rows.sort(key=lambda r: r["batch"])
    return rows


def make_ratios(rows: list[dict], strategies: list[str], baseline: str | None = None) -> dict[str, Any]:
    """speedup_vs_off per strategy and batch; the best strategy per batch (with `baseline`, also its
    speed-up over that system); headline batch-1 ratios (`tree_vs_off_batch1` is the first tree
    strategy listed)."""
    by = {(r["batch"], r["strategy"]): r for r in rows if r["tokens_per_s"] is not None}
    batches = sorted({b for b, s in by if s in strategies})
    ratios: dict[str, Any] = {
        "speedup_vs_off": {s: {str(b): by[b, s]["speedup_vs_off"] for b in batches if (b, s) in by}
                           for s in strategies if s != "off"},
        "best_by_batch": {},
    }
    for b in batches:
        best = max((s for s in strategies if (b, s) in by), key=lambda s: by[b, s]["tokens_per_s"])
        ratios["best_by_batch"][str(b)] = {"strategy": best, "speedup_vs_off": by[b, best]["speedup_vs_off"]}
        if baseline is not None:
            ratios["best_by_batch"][str(b)][f"speedup_vs_{baseline}"] = by[b, best].get(f"speedup_vs_{baseline}")
    tree = next((s for s in strategies if s.startswith("tree")), None)
    if tree is not None and (1, tree) in by:
        ratios["tree_vs_off_batch1"] = by[1, tree]["speedup_vs_off"]
        ratios["tree_strategy"] = tree
        if (1, HF_ASSISTED) in by:
            ratios["tree_vs_hf_assisted_batch1"] = by[1, tree]["tokens_per_s"] / by[1, HF_ASSISTED]["tokens_per_s"]
    if (1, HF) in by:
        if (1, "off") in by:
            ratios["off_vs_hf_batch1"] = by[1, "off"]["tokens_per_s"] / by[1, HF]["tokens_per_s"]
        if (1, HF_ASSISTED) in by:
            ratios["hf_assisted_vs_hf_batch1"] = by[1, HF_ASSISTED]["tokens_per_s"] / by[1, HF]["tokens_per_s"]
    return ratios


def format_table(rows: list[dict]) -> str:
    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    extra = next((k.removeprefix("speedup_") for r in rows for k in r
                  if k.startswith("speedup_vs_") and k != "speedup_vs_off"), None)  # vs_off_<dtype>
    header = (f"{'batch':>5}  {'strategy':20s}  {'tokens':>7}  {'wall s':>8}  {'tok/s':>9}  {'accept':>6}  {'vs off':>6}"
              f"  {'paired':>6}" + (f"  {extra.replace('_', ' '):>16}" if extra else ""))
    lines = [header, "-" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['batch']:>5}  {r['strategy']:20s}  error: {r['error']}")
            continue
        lines.append(f"{r['batch']:>5}  {r['strategy']:20s}  {r['tokens']:>7.0f}  {r['wall_s']:>8.2f}  "
                     f"{r['tokens_per_s']:>9.1f}  {num(r['acceptance_length'], '6.2f'):>6}  "
                     f"{num(r['speedup_vs_off'], '6.2f'):>6}  {num(r['paired_vs_off'], '6.2f'):>6}"
                     + (f"  {num(r.get('speedup_' + extra), '16.2f'):>16}" if extra else ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from tlt.io import atomic_write_json

    if args.threads:
        torch.set_num_threads(args.threads)
    fill_workload_defaults(args)
    record = measure(args.model, args.drafter, args.batch_sizes, args.strategies, args.temperature, args.max_tokens,
                     args.repeats, args.seed, args.skip_hf, args.prompts, args.device, args.dtype, args.baseline_dtype,
                     args.task, drafter_bits=args.drafter_bits, drafter_window=parse_drafter_window(args.drafter_window, "--drafter-window"))
    print(format_table(record["rows"]))
    print("accept: tokens per row per speculative step (hf-assisted: per target forward); "
          "vs off: tokens/s over plain decoding's at the same batch size; paired: the median over repeats of "
          "that ratio within a repeat")
    for k, v in record["ratios"].items():
        if isinstance(v, float):
            print(f"{k} = {v:.2f}")
    best = ", ".join(f"{b}: {x['strategy']}" for b, x in record["ratios"]["best_by_batch"].items())
    print(f"best strategy by batch size: {best}")
    if args.json is not None:
        atomic_write_json(args.json, record)
        print(f"wrote {args.json}")
    return 0
