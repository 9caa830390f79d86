"""Rollout on the long-tail workload: tlt's engine against transformers' generate, side by side.

The workload is one GRPO rollout of a model (the default one unless `--model`) on a built-in task
(`--task`; the bench policy's own for `--model bench`): P prompts x G samples at
temperature 1.0, each response running until its end-of-sequence token. Every system generates for the
same prompts with the same sampling settings; runs alternate between systems, in an order that rotates
every repeat, so machine noise hits all of them, and each figure is the median of `--repeats` runs.
`--hf-repeats N` runs transformers in the first N repeats only, and its ratios are then the median of
the ratios within those repeats. Ratios are baseline time / system time (> 1 means faster than the
baseline), of the medians; each
system's `paired_vs_off` is the median over repeats of the ratio within a repeat, steadier when the
machine's speed drifts between repeats. A PNG shows the live batch size over time: transformers keeps
finished rows in its batch to the end, tlt's batch shrinks as responses finish. `--dtype` sets the
weights' dtype of every system, tlt's and transformers' alike. `--baseline-dtype D` adds plain
decoding with weights in D (`off_D`, outside the fixed systems and the bound): on a CPU whose bf16
products of one or a few rows cost more than float32's, bf16 speculation is measured against both
plain decodings in one run (`<system>_vs_off_D`; `best_vs_off_D` is the fastest tlt system's).

Systems: `tlt_off` (plain decoding), `hf` (transformers' generate), each `--strategies` entry run at
every step (`tlt_<strategy>`), and with `--adaptive` the adaptive engine, whose tuner state is carried
from one rollout to the next as it is across RL steps (the untimed warm-up rollout is its first; a fixed
system's warm-up is one prompt's first WARMUP_TOKENS tokens).
`adaptive_vs_best_fixed` compares it with the fastest fixed system picked in hindsight; a second PNG
(beside `--plot`, its name + `_strategy`) shows which strategy the adaptive engine ran at each live
batch size. Each `--adaptive-arms A,B,...` adds an adaptive engine whose tuner competes over those
arms only (`tlt_adaptive:A+B+...`), to choose a workload's arm set by measurement: its ratios are
`adaptive:A+B+..._vs_off` and `_vs_best_fixed`. Each `--adaptive-tuner 'KEY=VALUE ...'` adds one whose
tuner takes those settings (`tlt_adaptive[KEY=VALUE ...]`), to compare tuner settings side by side.

Where the time goes: each tlt system's decode steps are split by live batch size into the tuner's
buckets: `bucket_seconds` and `bucket_tokens_per_s` (tokens emitted per second of those steps), medians
over the repeats. Seconds are not comparable bucket by bucket across systems (under speculation rows
advance at different rates: a looping row races ahead on n-gram drafts, so fewer of its tokens remain
when the batch reaches one row), throughputs are. `ratios.bucket_bound_vs_off` estimates the ceiling of
an adaptive engine over the measured fixed arms: plain decoding's step seconds over the time an oracle
would take to emit plain decoding's tokens of every bucket at the best fixed system's throughput in that
bucket, within each repeat (median over repeats). It needs the systems to draw the same samples
(target-only arms: `same_samples`).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

from tlt.bench import (add_workload_arguments, baseline_name, comma_list, fill_workload_defaults, paired,
                       parse_drafter_window, rotation, tokens_per_s, tuner_settings)
from tlt.device import synchronize
from tlt.model.checkpoint import DTYPE_NAMES


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.bench.forward import _positive_int

    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=_positive_int, default=16)
    parser.add_argument("--samples", type=_positive_int, default=8)
    parser.add_argument("--temperature", type=_non_negative_float, default=1.0)
    parser.add_argument("--repeats", type=_positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto: cuda when torch sees one)")
    parser.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    parser.add_argument("--hf-repeats", type=_positive_int, default=None, metavar="N",
                        help="run transformers in the first N repeats only (default: every repeat): its generate keeps "
                             "every row to the longest response, so at reasoning lengths one run takes many of tlt's; "
                             "its ratios then pair it with tlt's runs of those repeats")
    add_workload_arguments(parser)
    parser.add_argument("--strategies", default="",
                        help="fixed speculative strategies to run too, e.g. tree-d6-k4-v24,chain-d4,ngram-d4")
    parser.add_argument("--adaptive", action="store_true", help="run the adaptive engine too")
    parser.add_argument("--adaptive-arms", action="append", default=[], metavar="A,B,...",
                        help="also run an adaptive engine over these tuner arms only ('off' must be one); repeatable")
    parser.add_argument("--adaptive-tuner", action="append", default=[], metavar="'KEY=VALUE ...'",
                        help="also run an adaptive engine whose tuner takes these settings (space-separated; the keys "
                             "of tuner.* in a GRPO config, e.g. 'buckets=1,2,4,8,16,32 row_slope=false'); repeatable")
    parser.add_argument("--drafter-windows", default="", metavar="W,...",
                        help="drafter attention windows (auto, the default: a quarter of the window the drafter was trained "
                             "over; 0: the whole context; EngineConfig.drafter_window): with one, "
                             "every system drafts with it; with several, each drafter strategy runs once per window "
                             "as STRATEGY:wW, side by side, and the adaptive engines take the first")
    parser.add_argument("--drafter-bits", type=int, choices=(4, 16), default=16,
                        help="every drafting system drafts on the drafter's weights rounded to 4 bits where tlt's CPU "
                             "kernels run them, or as they are (16; EngineConfig.drafter_bits): drafts only, the "
                             "samples are unchanged")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                        help="the weights' dtype for every system, tlt's and transformers' alike")
    parser.add_argument("--baseline-dtype", choices=DTYPE_NAMES, default=None,
                        help="also run plain decoding with weights in this dtype (system `off_<dtype>`), the "
                             "baseline to beat where --dtype's plain decoding is not the fastest")
    parser.add_argument("--json", help="write config, rows and ratios here")
    parser.add_argument("--plot", default="runs/bench/rollout_live_batch.png")


def workload(args, tokenizer):
    from tlt.tasks import get_task

    problems = get_task(args.task).sample(args.prompts, seed=args.seed, split="eval")
    return [tokenizer.encode(p.prompt) for p in problems]


def run_tlt(model, prompts, args, repeat: int, config=None, tuner_state=None) -> dict:
    """One rollout with tlt's engine; `tuner_state` (adaptive) is loaded first and the new state is
    returned, so the tuner is carried from rollout to rollout as it is across RL steps."""
    from tlt.rollout import EngineConfig, RolloutEngine, SamplingParams

    engine = RolloutEngine(model, config=config or EngineConfig())
    if tuner_state is not None:
        engine.tuner.load_state_dict(tuner_state)
    params = [SamplingParams(n=args.samples, temperature=args.temperature, max_tokens=args.max_tokens,
                             seed=(repeat + 1) * 1000 + i) for i in range(len(prompts))]  # repeat -1 warms up
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    samples = [c.token_ids for o in outputs for c in o.outputs]
    lengths = list(map(len, samples))
    stats = engine.stats()
    return {"wall_s": wall, "tokens": sum(lengths), "lengths": lengths, "samples": samples,
            "step_s": stats["step_times_s"], "step_tokens": stats["step_tokens"], "batch_sizes": stats["batch_sizes"],
            "strategies": stats["strategies"], "acceptance_length": stats["acceptance_length"],
            "tuner_state": engine.tuner.state_dict() if engine.tuner is not None else None,
            "tuner": stats.get("tuner")}


ADAPTIVE = "tlt_adaptive"
WARMUP_TOKENS = 32  # tokens of a fixed system's untimed warm-up rollout (one prompt, one sample)


def adaptive_arms(text: str) -> tuple[str, ...]:
    """The arms of one `--adaptive-arms` value, checked as the tuner checks them."""
    from tlt.adaptive.tuner import TunerConfig
    from tlt.errors import ConfigError

    arms = tuple(comma_list(text))
    try:
        TunerConfig(arms=arms)
    except ConfigError as exc:
        raise ConfigError(f"--adaptive-arms {text!r}: {exc}") from None
    return arms


def adaptive_tuner(text: str):
    """The TunerConfig of one `--adaptive-tuner` value: the defaults with its KEY=VALUE settings."""
    return tuner_settings(text, "--adaptive-tuner")[0]


def fixed_strategies(text: str) -> list[str]:
    """The strategy names of `--strategies`, each checked as the engine parses it (plain decoding is
    always run as tlt_off, so "off" is not one of them)."""
    from tlt.errors import ConfigError
    from tlt.speculative.strategy import Strategy

    names = comma_list(text)
    for name in names:
        try:
            if Strategy.parse(name).kind == "off":
                raise ConfigError("plain decoding always runs, as tlt_off")
        except ConfigError as exc:
            raise ConfigError(f"--strategies {text!r}: {exc}") from None
    return names


def drafter_windows(text: str) -> list[int | str | None]:
    """The windows of `--drafter-windows` as EngineConfig.drafter_window values (auto, or 0: None, the
    whole context); ["auto"] when none is given."""
    from tlt.errors import ConfigError

    windows = [parse_drafter_window(item, f"--drafter-windows {text!r}") for item in comma_list(text)]
    if len(set(windows)) < len(windows):
        raise ConfigError(f"--drafter-windows {text!r}: a window is listed twice")
    return windows or ["auto"]


def carried_tuner(run_one):
    """A system running `run_one(repeat, tuner_state)` whose tuner state is carried from one rollout to
    the next, as it is across RL steps."""
    carried = {}

    def system(r):
        result = run_one(r, carried.get("state"))
        carried["state"] = result["tuner_state"]
        return result

    return system


def strategy_plot(plot: str) -> Path:
    """Where the adaptive engine's strategy plot goes: beside `--plot`, named after it, so runs with
    different `--plot` paths keep their own."""
    path = Path(plot)
    return path.with_name(f"{path.stem}_strategy.png")


def run_hf(hf_model, prompts, args, eos_id: int, pad_id: int, repeat: int) -> dict:
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=hf_model.device)
    mask = (ids != pad_id).long()
    torch.manual_seed(repeat)
    start = time.perf_counter()
    out = hf_model.generate(
        ids, attention_mask=mask, do_sample=args.temperature > 0, temperature=args.temperature or None,
        top_k=0, top_p=1.0, max_new_tokens=args.max_tokens, num_return_sequences=args.samples,
        eos_token_id=eos_id, pad_token_id=pad_id,
    )
    synchronize(hf_model.device)
    wall = time.perf_counter() - start
    new = out[:, width:]
    lengths = []
    for row in new.tolist():
        lengths.append(row.index(eos_id) + 1 if eos_id in row else len(row))
    steps = new.shape[1]
    return {"wall_s": wall, "tokens": sum(lengths), "lengths": lengths,
            "step_s": [wall / steps] * steps, "batch_sizes": [new.shape[0]] * steps}


def _cumulative(xs):
    total, out = 0.0, []
    for x in xs:
        total += x
        out.append(total)
    return out


def bucket_split(step_s: list[float], step_tokens: list[int], batch_sizes: list[int], tuner) -> dict[str, dict]:
    """Seconds and emitted tokens of the decode steps, summed per bucket of `tuner`'s live batch sizes:
    {"seconds": {label: s}, "tokens": {label: n}}, every bucket listed."""
    seconds, tokens = [0.0] * (len(tuner.config.buckets) + 1), [0] * (len(tuner.config.buckets) + 1)
    for s, n, size in zip(step_s, step_tokens, batch_sizes, strict=True):
        i = tuner.bucket_of(size)
        seconds[i] += s
        tokens[i] += n
    labels = [tuner.label(i) for i in range(len(seconds))]
    return {"seconds": dict(zip(labels, seconds)), "tokens": dict(zip(labels, tokens))}


def rates(split: dict) -> dict[str, float | None]:
    """Tokens per second in each bucket (None where the system spent no time)."""
    return {x: split["tokens"][x] / s if s > 0 else None for x, s in split["seconds"].items()}


def bucket_bound(splits: dict[str, dict], fixed: list[str], baseline: str = "tlt_off") -> tuple[float, dict[str, str]]:
    """(the baseline's step seconds / the time of its tokens at the best fixed throughput of each bucket,
    the best system of each bucket). `splits`: system -> `bucket_split` of one repeat."""
    off = splits[baseline]
    measured = {name: rates(splits[name]) for name in fixed}
    best, oracle = {}, 0.0
    for label, tokens in off["tokens"].items():
        here = {name: r[label] for name, r in measured.items() if r[label] is not None}
        if tokens and here:
            best[label] = max(here, key=here.get)
            oracle += tokens / here[best[label]]
    return sum(off["seconds"].values()) / oracle, best


def bucket_medians(per_repeat: list[dict]) -> dict[str, dict]:
    """`bucket_seconds` and `bucket_tokens_per_s` of one system: medians over its repeats' splits."""
    labels = list(per_repeat[0]["seconds"])
    speeds = [rates(r) for r in per_repeat]
    return {"bucket_seconds": {x: statistics.median(r["seconds"][x] for r in per_repeat) for x in labels},
            "bucket_tokens_per_s": {x: statistics.median(v) if (v := [r[x] for r in speeds if r[x] is not None])
                                    else None for x in labels}}


def summarize(runs: list[dict]) -> dict:
    wall = statistics.median(r["wall_s"] for r in runs)
    tokens = statistics.median(r["tokens"] for r in runs)
    out = {"wall_s": wall, "tokens": tokens, "tokens_per_s": statistics.median(map(tokens_per_s, runs)),
           "runs_wall_s": [r["wall_s"] for r in runs]}
    accepted = [r["acceptance_length"] for r in runs if r.get("acceptance_length") is not None]
    if accepted:
        out["acceptance_length"] = statistics.median(accepted)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from tlt.model import load_model
    from tlt.io import atomic_write_json
    from tlt.model.checkpoint import resolve_model_path
    from tlt.plots import live_batch, strategy_by_batch
    from tlt.tokenizer import load_tokenizer

    arm_sets = [adaptive_arms(text) for text in args.adaptive_arms]  # refused before anything loads
    tuners = {f"{ADAPTIVE}[{' '.join(text.split())}]": adaptive_tuner(text) for text in args.adaptive_tuner}
    if len(tuners) < len(args.adaptive_tuner):
        from tlt.errors import ConfigError

        raise ConfigError(f"--adaptive-tuner: a setting is listed twice in {args.adaptive_tuner}")
    windows = drafter_windows(args.drafter_windows)
    fill_workload_defaults(args)
    strategies = fixed_strategies(args.strategies)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model)
    from tlt.device import resolve_device

    device = resolve_device(args.device, "--device")
    model, tokenizer = load_model(folder, dtype=args.dtype, device=device), load_tokenizer(folder)
    from tlt.adaptive.tuner import Tuner, TunerConfig
    from tlt.rollout import EngineConfig
    from tlt.speculative import Drafter, Strategy
    from tlt.speculative.decoder import window_for

    prompts = workload(args, tokenizer)
    # Fixed systems take (repeat, args, prompts): their warm-up is a short rollout of one prompt.
    systems = {"tlt_off": lambda r, a=args, p=prompts: run_tlt(model, p, a, r)}
    drafter = Drafter.load(args.drafter, model) if strategies or args.adaptive or arm_sets or tuners else None
    for name in strategies:
        variants = windows if len(windows) > 1 and Strategy.parse(name).uses_drafter else windows[:1]
        for window in variants:
            config = EngineConfig(speculative="on", strategy=name, drafter=drafter, drafter_window=window,
                                  drafter_bits=args.drafter_bits)
            label = f"tlt_{name}:w{window or 0}" if len(variants) > 1 else f"tlt_{name}"
            systems[label] = lambda r, a=args, p=prompts, config=config: run_tlt(model, p, a, r, config)
    adaptive = dict(([(ADAPTIVE, TunerConfig())] if args.adaptive else []) +
                    [(f"{ADAPTIVE}:{'+'.join(arms)}", TunerConfig(arms=arms)) for arms in arm_sets])  # name -> tuner
    adaptive.update(tuners)
    for name, tuner in adaptive.items():
        config = EngineConfig(speculative="adaptive", drafter=drafter, tuner=tuner, drafter_window=windows[0],
                              drafter_bits=args.drafter_bits)
        systems[name] = carried_tuner(lambda r, state, config=config: run_tlt(model, prompts, args, r, config, state))
    baseline = baseline_name(args.baseline_dtype, args.dtype)
    if baseline is not None:
        other = load_model(folder, dtype=args.baseline_dtype, device=device)
        systems[baseline] = lambda r, a=args, p=prompts: run_tlt(other, p, a, r)
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=model.dtype).to(device).eval()
        systems["hf"] = lambda r, a=args, p=prompts: run_hf(hf_model, p, a, tokenizer.eos_token_id, tokenizer.pad_token_id, r)
    print(f"rollout bench: {args.dtype}, {args.prompts} prompts x {args.samples} samples, temperature {args.temperature}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}", file=sys.stderr)
    with torch.inference_mode():
        # Warm-up, not timed: the adaptive engines' is a full rollout (their tuners' first, carried as
        # across RL steps); a fixed system only needs its weights prepared and its code paths run once.
        short = argparse.Namespace(**{**vars(args), "samples": 1, "max_tokens": WARMUP_TOKENS})
        for name, fn in systems.items():
            fn(-1) if name in adaptive else fn(-1, short, prompts[:1])
        results = {name: [] for name in systems}
        for r in range(args.repeats):
            for name in rotation(list(systems), r):
                if name == "hf" and args.hf_repeats is not None and r >= args.hf_repeats:
                    continue
                results[name].append(systems[name](r))
                print(f"  run {r + 1}: {name:8s} {results[name][-1]['wall_s']:7.2f}s", file=sys.stderr)
    rows = {name: summarize(runs) for name, runs in results.items()}
    for name, runs in results.items():
        if name != "tlt_off":  # the median over repeats of tlt_off's wall / this system's (hf: the repeats it ran)
            base = results["tlt_off"][:len(runs)] if name == "hf" else results["tlt_off"]
            rows[name]["paired_vs_off"] = paired(runs, base, speed=lambda run: 1 / run["wall_s"])
    tuner = Tuner(TunerConfig())
    split = {name: [bucket_split(r["step_s"], r["step_tokens"], r["batch_sizes"], tuner) for r in runs]
             for name, runs in results.items() if name.startswith("tlt_")}  # per repeat
    for name, per_repeat in split.items():
        rows[name].update(bucket_medians(per_repeat))
    ratios = {}

    def vs_hf(name: str) -> float:
        """transformers' wall over `name`'s: of the medians, or with --hf-repeats the median of the
        repeats transformers ran, each against the same repeat's run."""
        if args.hf_repeats is None or args.hf_repeats >= args.repeats:
            return rows["hf"]["wall_s"] / rows[name]["wall_s"]
        return paired(results[name][:len(results["hf"])], results["hf"], speed=lambda run: 1 / run["wall_s"])

    if "hf" in rows:
        ratios["tlt_off_vs_hf"] = vs_hf("tlt_off")
    fixed = {name: row for name, row in rows.items() if name.startswith("tlt_") and name not in adaptive}
    best = min(fixed, key=lambda name: fixed[name]["wall_s"])
    ratios["best_fixed"] = best
    for name in adaptive:
        wall, key = rows[name]["wall_s"], name.removeprefix("tlt_")
        ratios[f"{key}_vs_off"] = rows["tlt_off"]["wall_s"] / wall
        ratios[f"{key}_vs_best_fixed"] = fixed[best]["wall_s"] / wall
        if "hf" in rows:
            ratios[f"{key}_vs_hf"] = vs_hf(name)
        if baseline is not None:
            ratios[f"{key}_vs_{baseline}"] = rows[baseline]["wall_s"] / wall
    if baseline is not None:
        ratios[f"tlt_off_vs_{baseline}"] = rows[baseline]["wall_s"] / rows["tlt_off"]["wall_s"]
        ratios[f"best_vs_{baseline}"] = rows[baseline]["wall_s"] / min(
            row["wall_s"] for name, row in rows.items() if name.startswith("tlt_"))
    for name in fixed:
        if name != "tlt_off":
            ratios[f"{name.removeprefix('tlt_')}_vs_off"] = rows["tlt_off"]["wall_s"] / fixed[name]["wall_s"]
    bounds = [bucket_bound({name: split[name][r] for name in fixed}, list(fixed)) for r in range(args.repeats)]
    ratios["bucket_bound_vs_off"] = statistics.median(b for b, _ in bounds)
    ratios["best_by_bucket"] = [best for _, best in bounds]  # per repeat
    tlt_runs = [runs for name, runs in results.items() if name.startswith("tlt_")]
    ratios["same_samples"] = all(r["samples"] == runs[0]["samples"] for runs in zip(*tlt_runs) for r in runs)
    width = max(map(len, rows))
    print(f"{'system':{width}s} {'wall s':>8s} {'tokens':>8s} {'tok/s':>9s} {'accept':>7s} {'paired':>7s}")
    for name, row in rows.items():
        accept = f"{row['acceptance_length']:7.2f}" if "acceptance_length" in row else f"{'-':>7s}"
        pair = f"{row['paired_vs_off']:7.2f}" if "paired_vs_off" in row else f"{'-':>7s}"
        print(f"{name:{width}s} {row['wall_s']:8.2f} {row['tokens']:8.0f} {row['tokens_per_s']:9.1f} {accept} {pair}")
    labels = list(rows["tlt_off"]["bucket_seconds"])
    print("step seconds / tokens per second by live batch size (medians)")
    print(f"{'system':{width}s} " + " ".join(f"{x:>13s}" for x in labels))
    for name, row in rows.items():
        if "bucket_seconds" in row:
            cells = [f"{row['bucket_seconds'][x]:5.2f}/" + (f"{r:<7.0f}" if (r := row["bucket_tokens_per_s"][x]) else f"{'-':7s}")
                     for x in labels]
            print(f"{name:{width}s} " + " ".join(cells))
    for k, v in ratios.items():
        print(f"{k} = {v:.2f}" if isinstance(v, float) else f"{k} = {v}")
    lengths = sorted(results["tlt_off"][0]["lengths"])
    print(f"response lengths (tlt run 1): median {lengths[len(lengths) // 2]}, max {lengths[-1]}")
    last = {name: (_cumulative(runs[-1]["step_s"]), runs[-1]["batch_sizes"]) for name, runs in results.items()}
    png = live_batch(last, args.plot, f"{args.prompts} prompts x {args.samples} samples, {args.model} model")
    print(f"wrote {png}")
    for name in adaptive:
        rows[name]["tuner"] = results[name][-1]["tuner"]
    if adaptive:  # the first adaptive system's strategies
        run = results[next(iter(adaptive))][-1]
        png = strategy_by_batch(run["batch_sizes"], run["strategies"], strategy_plot(args.plot))
        print(f"wrote {png}")
    if args.json:
        atomic_write_json(Path(args.json), {
            "config": {**{k: v for k, v in vars(args).items() if not k.startswith("_")},
                       "command_line": shlex.join(sys.argv),
                       "drafter_windows_applied": [window_for(w, drafter) for w in windows]},
            "threads": torch.get_num_threads(), "device": str(device), "rows": rows, "ratios": ratios,
        })
    return 0
