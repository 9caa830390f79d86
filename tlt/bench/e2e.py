"""End to end: the same GRPO run with speculation off and with tlt, step by step, side by side.

Trainers with the same config and seed but `speculative` (off vs adaptive) run in one process and
alternate step by step, so machine noise hits them alike. Each step's time is split by stage (rollout
/ reward / logprob / update / sync / drafter); eval time is excluded from step time. Ratios are off
time / tlt time (> 1: tlt is faster): `ratios.speedup` over the whole run and the median of per-step
ratios, and the same for rollout alone. Because speculation is lossless, the runs should learn alike;
reward and eval-accuracy curves go into the JSON (and a PNG), and `accuracy_gain` is the tlt run's
eval accuracy at the end minus at the start, in points. With the default arms (target-only
verification) the tlt run draws the off run's very samples; `matching_steps` counts the steps,
from the first, in which both runs had the same response lengths and rewards.

`--baseline-dtype D` adds a run `off_D`: plain decoding with rollout weights in D, the rest of the config
shared. With rollout_dtype=bfloat16 (where, on a CPU, speculation gains the most) and D=float32 it
measures tlt against plain decoding at the dtype where plain decoding is fastest on such a machine:
`ratios.speedup_vs_off_float32` and `rollout_speedup_vs_off_float32`. Its samples come from another
rounding of the same policy, so its curves match the others within noise only.

With drafter training on (the default when the tlt run has a learned drafter), a third run "frozen"
is the tlt run with the drafter kept as it started (drafter.train=off). It gives the two figures of
the adaptive drafter:
  - `ratios.acceptance_adaptive_vs_frozen`: the learned drafter's acceptance length in the tlt run over
    the frozen run's over the last 5 steps, compared arm by arm (an adaptive tuner runs the chain and
    tree arms in different proportions in the two runs, and a deeper arm accepts more whatever the
    drafter): per drafter arm, tokens / row-steps of each run; the headline is the mean of the per-arm
    ratios weighted by the tlt run's row-steps (`acceptance_by_arm` has each);
  - `ratios.drafter_overhead`: tlt step time over frozen step time (1.0: training fit in idle time).
`cold_start` compares, step by step, the acceptance of the learned drafter's depth-4 chain arm
(tree-d4-k1-v4 among the default arms, else chain-d4) with the n-gram drafter's ngram-d4 arm (same
depth) in the tlt run, and names the step from which the learned drafter stays ahead: the point where
a drafter started from random weights overtakes the model-free one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tlt.bench import baseline_name
from tlt.model.checkpoint import DTYPE_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=8, help="RL steps of each run")
    parser.add_argument("--model", help="the policy (model=); bench also sets the bench policy's task, drafter and "
                                        "response budget unless key=value gives them")
    parser.add_argument("--config", help="YAML file of TrainConfig fields shared by both runs")
    parser.add_argument("--tlt", default="adaptive", help="speculative mode of the tlt run (adaptive or on)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--workers", type=int, help="rollout workers (Ray when > 1; default: the config's)")
    parser.add_argument("--drafter", help="the tlt runs' starting drafter: a folder, default, references "
                                          "(trained on reference solutions), random (cold start)")
    parser.add_argument("--runs", default="off,tlt,frozen", help="which runs: off, tlt, frozen (comma-separated)")
    parser.add_argument("--baseline-dtype", choices=DTYPE_NAMES, default=None,
                        help="also run plain decoding with rollout weights in this dtype (run `off_<dtype>`), the "
                             "baseline to beat where the shared rollout_dtype's plain decoding is not the fastest")
    parser.add_argument("--json", help="write config, per-step rows, curves and ratios here")
    parser.add_argument("--out", default="runs/bench/e2e", help="folder for the runs and the plot")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="TrainConfig fields shared by both runs")


def run(args: argparse.Namespace) -> int:
    import torch

    from tlt.config import build
    from tlt.io import atomic_write_json
    from tlt.rl.config import TrainConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    extra = [f"steps={args.steps}"] + ([f"workers={args.workers}"] if args.workers else []) + \
        ([f"drafter.model={args.drafter}"] if args.drafter else [])
    base = build(TrainConfig, args.config, [*model_defaults(args.model), *args.overrides, *extra])
    result = compare(base, args.tlt, Path(args.out), runs=tuple(args.runs.split(",")),
                     baseline_dtype=args.baseline_dtype)
    if args.json:
        atomic_write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def model_defaults(model: str | None) -> list[str]:
    """key=value settings `--model` implies; given key=value overrides come after and win."""
    from tlt.bench_model import NAME, workload

    if model is None:
        return []
    if model != NAME:
        return [f"model={model}"]
    w = workload()
    return [f"model={NAME}", f"task={w['task']}", f"drafter.model={w['drafter']}", f"max_response_tokens={w['max_tokens']}"]


STAGES = ("rollout", "reward", "logprob", "update", "sync", "drafter")  # the timed parts of an RL step


def compare(base, tlt_mode: str = "adaptive", out: Path | None = None, log=print,
            runs: tuple[str, ...] = ("off", "tlt", "frozen"), baseline_dtype: str | None = None) -> dict:
    """Run `base` with speculation off, with `tlt_mode` and (when the drafter trains) with the drafter
    frozen, alternating step by step; returns the result dict (ratios, breakdown, curves). A
    `baseline_dtype` other than base's rollout_dtype adds the run `off_<dtype>`: speculation off with
    rollout weights in that dtype (float32 takes the engine's own log-probs, loss.old_logprobs=rollout),
    with ratios `speedup_vs_off_<dtype>` and `rollout_speedup_vs_off_<dtype>`. With `out`,
    each run's config.json and metrics.jsonl go to out/<run> (the layout `tlt report` reads) and the
    comparison plot to out/e2e.png."""
    from tlt.config import override, to_dict
    from tlt.errors import ConfigError
    from tlt.rl.side_by_side import SideBySide, matching_steps, speedups, total

    steps = base.steps
    unknown = set(runs) - {"off", "tlt", "frozen"}
    if unknown or "tlt" not in runs:
        raise ConfigError(f"--runs must include tlt and name only off, tlt, frozen; got {','.join(runs)}")
    trains = base.drafter.train != "off" and base.drafter.model is not None
    all_configs = {"off": override(base, {"speculative": "off"}),
                   "tlt": override(base, {"speculative": tlt_mode}),
                   "frozen": override(base, {"speculative": tlt_mode, "drafter.train": "off"})}
    configs = {name: all_configs[name] for name in runs if name != "frozen" or trains}
    baseline = baseline_name(baseline_dtype, base.rollout_dtype)
    if baseline is not None:
        configs[baseline] = override(base, {"speculative": "off", "rollout_dtype": baseline_dtype,
                                            "loss.old_logprobs": "rollout" if baseline_dtype == "float32" else "recompute"})
    side = SideBySide(configs, out)
    rows, evals = side.rows, side.evals
    log(f"{base.model} model, {base.prompts_per_step} prompts x {base.group_size} samples, {steps} RL steps, "
        f"speculation off vs {tlt_mode}, alternating step by step")
    start = time.perf_counter()
    try:
        side.evaluate()
        for step in range(1, steps + 1):
            latest = side.step()
            parts = "  ".join(f"{name} {r['time_step_s']:6.2f}s reward {r['reward']:.3f}" for name, r in latest.items())
            on = latest["tlt"]
            log(f"step {step:3d}  {parts}  accept tlt {on['acceptance_length'] or 0:.2f}"
                f" (drafter {on['drafter_acceptance_length'] or 0:.2f})"
                + (f" frozen {latest['frozen']['drafter_acceptance_length'] or 0:.2f}" if "frozen" in latest else ""))
    finally:
        side.close()

    ratios = speedups(rows["off"], rows["tlt"]) if "off" in rows else {}
    if baseline is not None:
        ratios[f"speedup_vs_{baseline}"] = total(rows[baseline], "time_step_s") / total(rows["tlt"], "time_step_s")
        ratios[f"rollout_speedup_vs_{baseline}"] = (total(rows[baseline], "time_rollout_s") /
                                                    total(rows["tlt"], "time_rollout_s"))
    if "frozen" in rows:
        ratios.update(alignment(rows["tlt"], rows["frozen"]))
    first, last = evals["tlt"][0]["eval_accuracy"], evals["tlt"][-1]["eval_accuracy"]
    result = {
        "config": to_dict(base), "tlt_mode": tlt_mode, "steps": steps, "runs": list(rows),
        "ratios": ratios,
        "accuracy_gain": 100.0 * (last - first),
        "breakdown_s": {name: {s: total(rows[name], f"time_{s}_s") for s in STAGES} for name in rows},
        "curves": {name: {"reward": [r["reward"] for r in rows[name]], "eval": evals[name],
                          "step_time_s": [r["time_step_s"] for r in rows[name]],
                          "acceptance_length": [r["acceptance_length"] for r in rows[name]],
                          "drafter_acceptance_length": [r["drafter_acceptance_length"] for r in rows[name]],
                          "acceptance_by_strategy": [r["acceptance_by_strategy"] for r in rows[name]],
                          "drafter_version": [r.get("drafter_version") for r in rows[name]],
                          "drafter_phase_steps": [r.get("drafter_phase_steps") for r in rows[name]],
                          "drafter_phase_kept": [r.get("drafter_phase_kept") for r in rows[name]],
                          "drafter_stop_latency_s": [r.get("drafter_stop_latency_s") for r in rows[name]]}
                   for name in rows},
        "cold_start": cold_start(rows["tlt"]),
        "matching_steps": matching_steps(rows["off"], rows["tlt"]) if "off" in rows else None,
        "wall_s": time.perf_counter() - start,
    }
    if "off" in rows:
        result["accuracy_gain_off"] = 100.0 * (evals["off"][-1]["eval_accuracy"] - evals["off"][0]["eval_accuracy"])
        log(f"speed-up (off time / tlt time): whole run {ratios['speedup']:.2f}, median step "
            f"{ratios['speedup_median_step']:.2f}, rollout {ratios['rollout_speedup']:.2f}; "
            f"rollout share of step time (off) {ratios['rollout_share']:.0%}, so at most "
            f"{ratios['amdahl_bound']:.2f} from the rollout speed-up alone")
        log(f"steps with the same response lengths and rewards in both runs, from the first: "
            f"{result['matching_steps']} of {steps}")
    if baseline is not None:
        log(f"speed-up over {baseline} ({baseline} time / tlt time): whole run "
            f"{ratios[f'speedup_vs_{baseline}']:.2f}, rollout {ratios[f'rollout_speedup_vs_{baseline}']:.2f}")
    if "frozen" in rows:
        aligned = ratios["acceptance_adaptive_vs_frozen"]
        arms = ", ".join(f"{a} {v['ratio']:.2f}x" for a, v in ratios["acceptance_by_arm"].items())
        log(f"adaptive vs frozen drafter: acceptance {'n/a' if aligned is None else f'{aligned:.2f}x'} "
            f"(last 5 steps, arm by arm: {arms or 'no arm ran in both'}), step time {ratios['drafter_overhead']:.3f}x "
            f"(median step {ratios['drafter_overhead_median_step']:.3f}x)")
    if result["cold_start"]["overtake_step"] is not None:
        log(f"learned drafter ({result['cold_start']['learned_arm']}) ahead of the n-gram drafter "
            f"({result['cold_start']['ngram_arm']}) from step {result['cold_start']['overtake_step']}")
    for name in rows:
        parts = "  ".join(f"{s} {result['breakdown_s'][name][s]:.1f}s" for s in STAGES)
        log(f"  {name:>6}: {parts}")
    log("eval accuracy: " + ", ".join(f"{name} {evals[name][0]['eval_accuracy']:.3f} -> {evals[name][-1]['eval_accuracy']:.3f}"
                                      for name in rows))
    if out is not None:
        _plot(result, out / "e2e.png")
        log(f"wrote {out / 'e2e.png'}")
    return result


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def alignment(tlt_rows: list[dict], frozen_rows: list[dict], last: int = 5) -> dict:
    """Acceptance of the learned drafter, adaptive over frozen (last `last` steps and last step), and the
    step-time overhead of training it (total and median per-step ratio)."""
    from tlt.speculative.strategy import Strategy

    def per_arm(rows):
        tokens, count = {}, {}
        for r in rows[-last:]:
            for arm, n in r.get("rows_by_strategy", {}).items():
                if Strategy.parse(arm).uses_drafter:
                    tokens[arm] = tokens.get(arm, 0.0) + r["acceptance_by_strategy"][arm] * n
                    count[arm] = count.get(arm, 0) + n
        return {a: (tokens[a] / count[a], count[a]) for a in tokens}

    ours, theirs = per_arm(tlt_rows), per_arm(frozen_rows)
    arms = {a: {"adaptive": ours[a][0], "frozen": theirs[a][0], "ratio": ours[a][0] / theirs[a][0],
                "row_steps_adaptive": ours[a][1], "row_steps_frozen": theirs[a][1]}
            for a in sorted(set(ours) & set(theirs))}
    weight = sum(v["row_steps_adaptive"] for v in arms.values())
    headline = sum(v["ratio"] * v["row_steps_adaptive"] for v in arms.values()) / weight if weight else None
    return {
        "acceptance_adaptive_vs_frozen": headline,
        "acceptance_by_arm": arms,
        "drafter_acceptance_adaptive_last": _mean(r["drafter_acceptance_length"] for r in tlt_rows[-last:]),
        "drafter_acceptance_frozen_last": _mean(r["drafter_acceptance_length"] for r in frozen_rows[-last:]),
        "drafter_overhead": sum(r["time_step_s"] for r in tlt_rows) / sum(r["time_step_s"] for r in frozen_rows),
        "drafter_overhead_median_step": statistics.median(a["time_step_s"] / b["time_step_s"]
                                                          for a, b in zip(tlt_rows, frozen_rows)),
    }


LEARNED_CHAINS = ("tree-d4-k1-v4", "chain-d4")  # the learned drafter's depth-4 chain arms, by preference


def cold_start(rows: list[dict], learned: str | None = None, ngram: str = "ngram-d4") -> dict:
    """Per step, the acceptance of the learned drafter's `learned` arm (None: the first of
    LEARNED_CHAINS that ran) and the n-gram `ngram` arm (same depth); `overtake_step` is the first step
    from which the learned arm is ahead in every later step where both ran (None: it never is)."""
    if learned is None:
        ran = {arm for r in rows for arm in r["acceptance_by_strategy"]}
        learned = next((arm for arm in LEARNED_CHAINS if arm in ran), LEARNED_CHAINS[0])
    pairs = [(i + 1, r["acceptance_by_strategy"].get(learned), r["acceptance_by_strategy"].get(ngram))
             for i, r in enumerate(rows)]
    both = [(s, a, b) for s, a, b in pairs if a is not None and b is not None]
    overtake = None
    for j, (s, _, _) in enumerate(both):
        if all(a > b for _, a, b in both[j:]):
            overtake = s
            break
    return {"learned_arm": learned, "ngram_arm": ngram, "learned": [a for _, a, _ in pairs],
            "ngram": [b for _, _, b in pairs], "overtake_step": overtake}


def _plot(result: dict, path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tlt.io import atomic_write_bytes

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.2))
    styles = {"off": "-", "tlt": "--", "frozen": ":"}
    for name in result["curves"]:
        style = styles.get(name, "-.")
        curve = result["curves"][name]
        steps = range(1, len(curve["reward"]) + 1)
        left.plot(steps, curve["reward"], style, label=f"{name}: train reward")
        left.plot([e["step"] for e in curve["eval"]], [e["eval_accuracy"] for e in curve["eval"]], style,
                  marker="o", label=f"{name}: eval accuracy")
        middle.plot(steps, curve["step_time_s"], style, label=name)
        if not name.startswith("off"):
            right.plot(steps, [a if a is not None else float("nan") for a in curve["drafter_acceptance_length"]],
                       style, label=f"{name}: learned drafter")
    cold = result["cold_start"]
    if any(v is not None for v in cold["ngram"]):
        steps = range(1, len(cold["ngram"]) + 1)
        right.plot(steps, [v if v is not None else float("nan") for v in cold["ngram"]], "-.", marker=".",
                   label=f"tlt: {cold['ngram_arm']} (n-gram)")
        right.plot(steps, [v if v is not None else float("nan") for v in cold["learned"]], "-.", marker="x",
                   label=f"tlt: {cold['learned_arm']} (learned)")
    speedup = result["ratios"].get("speedup")
    left.set(xlabel="RL step", ylabel="reward / accuracy", title="Learning")
    middle.set(xlabel="RL step", ylabel="step time (s)",
               title="Step time" + (f" (speed-up {speedup:.2f}x)" if speedup else ""))
    aligned = result["ratios"].get("acceptance_adaptive_vs_frozen")
    right.set(xlabel="RL step", ylabel="acceptance length (tokens / step)",
              title="Drafter acceptance" + (f" (adaptive / frozen {aligned:.2f}x)" if aligned else ""))
    for ax in (left, middle, right):
        ax.legend(fontsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
