"""History drafts: a fixed dataset trained for several epochs, suffix drafter vs n-gram drafter on the same samples.

RL revisits each prompt once an epoch, and the suffix drafter (tlt/speculative/suffix.py) drafts from
the prompt's earlier responses (the run's history store) besides the group. Two measurements, each a GRPO
run over `--problems` built-in problems (or the config's dataset) for `--epochs` epochs:

  --measure acceptance: one run drafts with the suffix strategy (`--suffix`, speculation on); every
    training rollout is generated again, same prompts, seeds and weights, by engines sharing its model
    with each `--paired` strategy (the n-gram drafter first). All strategies verify target-only, so
    every engine draws the same samples (checked, `same_samples`). Acceptance length (tokens per row per
    step) per epoch; `acceptance_suffix_vs_ngram` is the suffix drafter's over the n-gram drafter's from
    epoch 2 on (steps whose prompts were seen before), pooled over those steps' row-steps. Counts
    tokens, not time: machine load does not matter. With drafter.model=random (a cold start) the
    drafter starts random and trains on the run's rollouts as drafter.train says, and the paired
    learned strategies draft with it as it learns (each row records its `drafter_version`).
  --measure speedup: two adaptive runs alternating step by step, the tuner's arms without and with the
    suffix arms (`--arms`), and one more with them per `--tuner 'KEY=VALUE ...'` (other tuner settings,
    `rollout_speedup_by_tuner`); all draw the same samples (target-only arms; `matching_steps` counts the
    steps whose responses agree); `speedup_with_suffix_arms` is total rollout time without over with,
    with the whole-step ratio, the per-bucket arm choices of the run with the new arms, and per epoch, tuner
    bucket and arm, the tokens a second each run's arms earned where the tuner ran them.

  --measure buckets: the acceptance run's paired engines, plain decoding among them, timed: tokens a
    second of each system per live-batch bucket (the tuner's buckets) from epoch 2 on, the best system
    per bucket, and `per_bucket_bound_over_off`, the rollout speed-up over plain decoding that choosing
    the best of these systems in every bucket could give (what the tuner can reach with them as arms).
    The systems take turns within each rollout, rotated by one a rollout. Times, so machine load matters.

Each merges its figures and the command line into `--json` (default docs/results/history_drafts.json).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

from tlt.bench import rotation, tuner_settings
from tlt.config import override
from tlt.rollout.stats import RolloutStats

SUFFIX_ARMS = ("suffix-d16-v32", "hybrid-d4-k4-v16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--measure", choices=("acceptance", "speedup", "buckets"), default="acceptance")
    parser.add_argument("--problems", type=int, default=64, help="training problems (the fixed dataset)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--suffix", default="suffix-d16-v32", help="acceptance: the suffix strategy the run drafts with")
    parser.add_argument("--paired", default="ngram-d4", help="acceptance, buckets: strategies run on the same samples "
                                                             "(comma-separated; for acceptance the first is the n-gram "
                                                             "baseline; buckets adds off)")
    parser.add_argument("--arms", default=",".join(SUFFIX_ARMS), help="speedup: the arms added to the tuner's")
    parser.add_argument("--tuner", action="append", default=[], metavar="'KEY=VALUE ...'",
                        help="speedup: one more run with the added arms whose tuner takes these settings, alternating "
                             "step by step with the others (repeatable)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--plot", help="speedup: draw the tuner's choice per live batch size, epoch 2 on, here (PNG)")
    parser.add_argument("--json", default="docs/results/history_drafts.json", help="merge the figures into this file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="TrainConfig fields of the runs")


def run(args: argparse.Namespace) -> int:
    import torch

    from tlt.bench import comma_list
    from tlt.config import build
    from tlt.errors import ConfigError
    from tlt.rl.config import TrainConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    for name in ("problems", "epochs", "prompts_per_step", "group"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    steps = math.ceil(args.epochs * args.problems / args.prompts_per_step)
    base = build(TrainConfig, None, [f"train_problems={args.problems}", f"prompts_per_step={args.prompts_per_step}",
                                     f"group_size={args.group}", f"steps={steps}", "eval.every=0", "save_every=0",
                                     "workers=1", *args.overrides])
    command = " ".join(["tlt bench history", f"--measure {args.measure}", f"--problems {args.problems}",
                        f"--epochs {args.epochs}", f"--prompts-per-step {args.prompts_per_step}", f"--group {args.group}",
                        *([f"--suffix {args.suffix}", f"--paired {args.paired}"] if args.measure != "speedup"
                          else [f"--arms {args.arms}", *(f"--tuner {shlex.quote(t)}" for t in args.tuner)]),
                        *([f"--threads {args.threads}"] if args.threads else []),
                        *(shlex.quote(o) for o in args.overrides)])
    if args.measure == "acceptance":
        result = acceptance(base, args.suffix, comma_list(args.paired))
        figures = {"acceptance_suffix_vs_ngram": result["ratio"], "acceptance_command": command,
                   "acceptance": result}
    elif args.measure == "buckets":
        result = buckets(base, args.suffix, comma_list(args.paired))
        figures = {"per_bucket_bound_over_off": result["per_bucket_bound_over_off"], "buckets_command": command,
                   "buckets": result}
    else:
        result = speedup(base, tuple(comma_list(args.arms)), args.tuner)
        figures = {"speedup_with_suffix_arms": result["rollout_speedup"], "speedup_command": command,
                   "speedup": result}
        if args.plot:
            from tlt.plots import strategy_by_batch

            by_epoch = result["choices_by_batch_size_with_by_epoch"]
            later = [by_size for e, by_size in by_epoch.items() if int(e) >= 2]
            title = "tuner with the added arms, " + ("epoch 2 on" if later else "epoch 1")
            sizes, names = choice_steps(later or list(by_epoch.values()))
            print(f"wrote {strategy_by_batch(sizes, names, args.plot, title)}")
    if args.json:
        from tlt.io import atomic_write_json

        path = Path(args.json)
        merged = json.loads(path.read_text()) if path.exists() else {}
        merged.update(figures)
        atomic_write_json(path, merged)
        print(f"wrote {path}")
    return 0


def arm_rates(rows: list[dict], tuner) -> dict[str, dict[str, dict]]:
    """Per tuner bucket (its label) and arm: decode steps, seconds, tokens and tokens a second, summed over the
    metric rows' `strategy_by_batch`, `time_decode_by_batch_s` and `tokens_by_batch`: what each arm earned where
    the tuner ran it (a step's seconds include the prefill of rows admitted before it, as the engine times it)."""
    from tlt.report import summed_by_batch

    tables = {name: summed_by_batch(rows, key) for name, key in
              (("steps", "strategy_by_batch"), ("seconds", "time_decode_by_batch_s"), ("tokens", "tokens_by_batch"))}
    by_bucket: dict[int, dict[str, dict]] = {}
    for size, by_arm in tables["steps"].items():
        bucket = by_bucket.setdefault(tuner.bucket_of(size), {})
        for arm in by_arm:
            slot = bucket.setdefault(arm, {"steps": 0, "seconds": 0.0, "tokens": 0})
            for name, table in tables.items():
                slot[name] += table[size][arm]
    for by_arm in by_bucket.values():
        for slot in by_arm.values():
            slot["tokens_per_s"] = slot["tokens"] / slot["seconds"] if slot["seconds"] else None
    return {tuner.label(i): by_bucket[i] for i in sorted(by_bucket)}


def choice_steps(choices: list[dict[str, dict[str, int]]]) -> tuple[list[int], list[str]]:
    """The (batch size, arm) of every step that the `choices` tables (batch size -> arm -> steps) count, as the
    choice plot takes them."""
    pairs = [(int(size), arm) for table in choices for size, by_arm in table.items() for arm, n in by_arm.items()
             for _ in range(n)]
    return [s for s, _ in pairs], [a for _, a in pairs]


def epoch_of(step: int, prompts_per_step: int, problems: int) -> int:
    """1-based epoch of 0-based RL step `step` (the epoch of its first prompt)."""
    return step * prompts_per_step // problems + 1


def counts(stats: RolloutStats) -> tuple[int, int, int]:
    """(tokens, row-steps, draft tokens verified) of a rollout's speculative steps (acceptance length =
    tokens / row-steps; its cost in verified draft tokens a row-step = drafted / row-steps)."""
    tokens, rows, drafted = (sum(stats.summed_by_strategy(v).values())
                             for v in (stats.step_tokens, stats.batch_sizes, stats.step_drafted))
    return tokens, rows, drafted


class PairedRollout:
    """The trainer's rollout backend, plus engines sharing its model that generate every training
    rollout again with other strategies; records each system's (tokens, row-steps) per rollout and
    whether its samples equal the backend's."""

    def __init__(self, backend, engines: dict, primary: str) -> None:
        self.backend, self.engines, self.primary = backend, engines, primary
        self.rollouts: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def generate(self, prompts, params, weights_version, step, learn=True, **drafts):
        if not learn:
            return self.backend.generate(prompts, params, weights_version, step, learn=learn, **drafts)
        # The systems run in turns, rotated by one each rollout, so none is always first while the host's
        # speed drifts (the bucket times); each sees the same history, which the trainer extends afterwards.
        record, samples = {}, {}
        for name in rotation([self.primary, *self.engines], len(self.rollouts)):
            if name == self.primary:
                outputs, report = self.backend.generate(prompts, params, weights_version, step, learn=learn, **drafts)
                out, stats = outputs, report.stats
            else:
                engine = self.engines[name]
                engine.reset_stats()
                out = engine.generate(prompts, params, **drafts)
                stats = engine.rollout_stats
            samples[name] = [c.token_ids for o in out for c in o.outputs]
            record[name] = {"counts": counts(stats), "sources": stats.sources, "stats": stats}
        for name in self.engines:
            record[name]["same_samples"] = samples[name] == samples[self.primary]
        self.rollouts.append(record)
        return outputs, report


def paired_run(base, suffix: str, paired: list[str], log=print) -> tuple:
    """A run drafting with `suffix`, each training rollout generated again by every `paired` strategy on
    the same samples: (config, problems, per-step rows, per-rollout records of PairedRollout, the run's own
    engine's suffix calibration as `calibration_rows` reads it)."""
    from tlt.errors import ConfigError
    from dataclasses import replace

    from tlt.rl.trainer import GRPOTrainer
    from tlt.rollout import RolloutEngine
    from tlt.speculative import Drafter, Strategy

    if not paired:
        raise ConfigError("--paired must name at least one strategy to run on the same samples")
    if suffix in paired or len(set(paired)) < len(paired):
        raise ConfigError(f"--paired names a strategy twice or the run's own (--suffix {suffix}): {','.join(paired)}")
    if Strategy.parse(suffix).kind not in ("suffix", "hybrid"):
        raise ConfigError(f"--suffix must be a suffix or hybrid strategy, got {suffix!r}")
    for name in paired:
        if name != "off" and not Strategy.parse(name).target_only:
            raise ConfigError(f"--paired {name!r} does not verify target-only: its samples would differ")
    learned = Strategy.parse(suffix).uses_drafter
    # drafter.model=random is a cold start: the drafter starts random and learns from the run's rollouts as
    # configured (drafter.train), and the paired learned strategies draft with it as it learns
    cold = base.drafter.model == "random"
    config = override(base, {"speculative": "on", "strategy": suffix,
                             "drafter.train": base.drafter.train if cold else "off",
                             "drafter.model": base.drafter.model if learned or cold else None})
    trainer = GRPOTrainer(config, log=lambda *_: None)
    if trainer.engine is None:
        raise ConfigError("the acceptance measurement runs in-process (workers=1)")
    model, drafter = trainer.engine.model, trainer.engine.drafter
    engines = {}
    for name in paired:
        uses = Strategy.parse(name).uses_drafter
        if uses and drafter is None:
            drafter = Drafter.load("default" if base.drafter.model in (None, "auto") else base.drafter.model, model)
        # the run's own engine settings (batch size, drafter windows and bits), another strategy
        engines[name] = RolloutEngine(model, trainer.tokenizer, replace(
            trainer.engine.config, speculative="off" if name == "off" else "on",
            strategy=None if name == "off" else name, tuner=None, drafter=drafter if uses else None, progress=False))
    trainer.rollout_backend = PairedRollout(trainer.rollout_backend, engines, suffix)
    problems = len(trainer.train_examples)
    log(f"{config.model}: {problems} problems x {config.group_size} samples, {config.prompts_per_step} per step, "
        f"{config.steps} steps; drafting with {suffix}, paired with {', '.join(paired)} on the same samples")
    rows = []
    for step in range(config.steps):
        metrics = trainer.train_step()
        record = trainer.rollout_backend.rollouts[-1]
        row = {"step": step + 1, "epoch": epoch_of(step, config.prompts_per_step, problems),
               "reward": metrics["reward"], "history_hit_rate": metrics.get("history_hit_rate"),
               "history_bytes": metrics.get("history_bytes"), "drafter_version": metrics.get("drafter_version"), **{
                   name: {"tokens": r["counts"][0], "row_steps": r["counts"][1], "drafted": r["counts"][2],
                          # None where the system ran no speculative step (plain decoding)
                          "acceptance_length": r["counts"][0] / r["counts"][1] if r["counts"][1] else None,
                          "drafted_per_row_step": r["counts"][2] / r["counts"][1] if r["counts"][1] else None,
                          "sources": r["sources"],
                          **({"same_samples": r["same_samples"]} if "same_samples" in r else {})}
                   for name, r in record.items()}}
        rows.append(row)
        log(f"step {row['step']:3d} epoch {row['epoch']}  " + "  ".join(
            f"{name} {row[name]['acceptance_length']:.2f}" for name in record if row[name]["row_steps"]))
    calibration = calibration_rows(trainer.engine.decoder.calibration)
    trainer.close()
    return config, problems, rows, trainer.rollout_backend.rollouts, calibration


def calibration_rows(calibration) -> list[dict]:
    """A suffix.Calibration's tables as rows: how often verification accepted a draft node whose parent it
    accepted, per (count of the node's token after its context, count of the other tokens), both capped, and
    per the same and the matched context's length (`matched`: the bucket's least length, a power of two).
    Each key's counts are after its own halvings (the recent share of what it saw): the finer keys fill more
    slowly and halve later, so they split a (count, others) row exactly only until that row first halves."""
    rows = [{"count": c, "others": o, "reached": round(r, 1), "accepted": round(a, 1), "rate": a / r}
            for (c, o), (r, a) in sorted(calibration.table.items()) if r]
    rows += [{"count": c, "others": o, "matched": 2 ** m, "reached": round(r, 1), "accepted": round(a, 1),
              "rate": a / r} for (c, o, m), (r, a) in sorted(calibration.by_match.items()) if r]
    return rows


def acceptance(base, suffix: str, paired: list[str], log=print) -> dict:
    """Acceptance length of `suffix` and each `paired` strategy on the same samples, by epoch."""
    from tlt.errors import ConfigError

    if "off" in paired:
        raise ConfigError("--paired off has no acceptance to compare (plain decoding drafts nothing); "
                          "it is a system of --measure buckets")
    start = time.perf_counter()
    config, problems, rows, _, calibration = paired_run(base, suffix, paired, log)
    systems = [suffix, *paired]

    def pooled(name, rows, key="tokens"):
        total, row_steps = sum(r[name][key] for r in rows), sum(r[name]["row_steps"] for r in rows)
        return total / row_steps if row_steps else None

    epochs = sorted({r["epoch"] for r in rows})
    by_epoch = {e: {name: pooled(name, [r for r in rows if r["epoch"] == e]) for name in systems} for e in epochs}
    later = [r for r in rows if r["epoch"] >= 2]
    suffix_later, ngram_later = pooled(suffix, later), pooled(paired[0], later)
    sources: dict[str, list[int]] = {}
    for r in later:
        for name, c in r[suffix]["sources"].items():
            total = sources.setdefault(name, [0, 0, 0])
            total[:] = [a + b for a, b in zip(total, c)]
    result = {
        "model": config.model, "problems": problems, "epochs": max(epochs), "group_size": config.group_size,
        "prompts_per_step": config.prompts_per_step, "steps": config.steps, "suffix": suffix, "paired": paired,
        "ratio": suffix_later / ngram_later if suffix_later and ngram_later else None,
        "acceptance_epoch_2_on": {name: pooled(name, later) for name in systems},
        # the cost side: draft tokens each row verified a step
        "drafted_per_row_step_epoch_2_on": {name: pooled(name, later, "drafted") for name in systems},
        "acceptance_by_epoch": by_epoch,
        # per source of the suffix drafts, epoch 2 on: [row-steps, tokens emitted, draft tokens accepted]
        "suffix_sources_epoch_2_on": sources,
        "source_acceptance_epoch_2_on": {name: c[1] / c[0] for name, c in sources.items() if c[0]},
        "same_samples": all(r[name].get("same_samples", True) for r in rows for name in paired),
        "calibration": calibration, "rows": rows, "wall_s": time.perf_counter() - start,
    }
    ratio = result["ratio"]
    drafted = result["drafted_per_row_step_epoch_2_on"]
    log("acceptance from epoch 2 on (draft tokens verified a row-step): " + ", ".join(
        f"{n} {v:.2f} ({drafted[n]:.2f})" for n, v in result["acceptance_epoch_2_on"].items() if v is not None)
        + (f"; {suffix} / {paired[0]} = {ratio:.2f}x" if ratio else "")
        + f"; same samples in every rollout: {result['same_samples']}")
    return result


def buckets(base, suffix: str, paired: list[str], log=print) -> dict:
    """Tokens a second per live-batch bucket of `suffix`, each `paired` strategy and plain decoding ("off",
    added when not named), on the same samples from epoch 2 on, and the speed-up a per-bucket choice among them
    could give over plain decoding."""
    from tlt.adaptive.tuner import Tuner
    from tlt.bench.rollout import bucket_bound, bucket_split, rates

    paired = list(paired) if "off" in paired else ["off", *paired]
    start = time.perf_counter()
    config, problems, rows, records, calibration = paired_run(base, suffix, paired, log)
    tuner = Tuner(config.tuner)  # its buckets only
    repeated = any(row["epoch"] >= 2 for row in rows)
    counted = [r for r, row in zip(records, rows) if row["epoch"] >= 2 or not repeated]
    systems = [suffix, *paired]
    merged = {name: RolloutStats.merge([r[name]["stats"] for r in counted]) for name in systems}
    splits = {name: bucket_split(m.step_times, m.step_tokens, m.batch_sizes, tuner) for name, m in merged.items()}
    bound, best = bucket_bound(splits, systems, baseline="off")
    seconds = {name: sum(split["seconds"].values()) for name, split in splits.items()}
    by_system = {name: {"seconds": split["seconds"], "tokens": split["tokens"], "tokens_per_s": rates(split)}
                 for name, split in splits.items()}
    result = {
        "model": config.model, "problems": problems, "epochs": max(r["epoch"] for r in rows),
        "group_size": config.group_size, "prompts_per_step": config.prompts_per_step, "steps": config.steps,
        "suffix": suffix, "paired": paired, "epochs_counted": "2 on" if repeated else "all",
        "decode_seconds": seconds, "speedup_over_off": {name: seconds["off"] / s for name, s in seconds.items() if s},
        "buckets": by_system, "best_by_bucket": best, "per_bucket_bound_over_off": bound,
        # tokens a row-step of each system's speculative steps, per RL step (None: plain decoding)
        "acceptance_by_step": {name: [row[name]["acceptance_length"] for row in rows] for name in systems},
        "same_samples": all(r[name]["same_samples"] for r in records for name in paired),
        "calibration": calibration, "wall_s": time.perf_counter() - start,
    }
    for label, winner in best.items():
        log(f"  {label:>7} rows  " + "  ".join(f"{name} {by_system[name]['tokens_per_s'][label] or 0:6.0f}"
                                               for name in systems) + f" tokens/s; best {winner}")
    log(f"per-bucket choice among these systems: at most {bound:.2f}x plain decoding (each fixed: "
        + ", ".join(f"{n} {v:.2f}x" for n, v in result["speedup_over_off"].items()) + ")"
        + f"; same samples in every rollout: {result['same_samples']}")
    return result


def speedup(base, arms: tuple[str, ...], tuners: Sequence[str] = (), log=print) -> dict:
    """Adaptive runs with the tuner's arms without and with `arms`, alternating step by step; each of `tuners`
    ('KEY=VALUE ...' tuner settings) adds a run with `arms` whose tuner takes them, named "with[KEY=VALUE ...]"
    (`rollout_speedup_by_tuner`: the run without the arms over each run with them)."""
    from tlt.adaptive.tuner import Tuner
    from tlt.bench.e2e import STAGES
    from tlt.report import summed_by_batch
    from tlt.errors import ConfigError
    from tlt.rl.side_by_side import matching_steps
    from tlt.rl.trainer import GRPOTrainer

    if not arms:
        raise ConfigError("--arms must name at least one arm to add")
    without = tuple(a for a in base.tuner.arms if a not in arms)
    settings = {"with": {}}  # run name -> its tuner settings beside the arms
    for text in tuners:
        tuner, keys = tuner_settings(text, "--tuner")
        if "arms" in keys:
            raise ConfigError(f"--tuner {text!r}: the arms are the run's own (--arms adds to them); set the others")
        name = f"with[{' '.join(text.split())}]"
        if name in settings:
            raise ConfigError(f"--tuner {text!r} is given twice")
        settings[name] = {f"tuner.{key}": getattr(tuner, key) for key in keys}
    configs = {"without": override(base, {"speculative": "adaptive", "tuner.arms": without}),
               **{name: override(base, {"speculative": "adaptive", "tuner.arms": without + arms, **tuned})
                  for name, tuned in settings.items()}}
    trainers = {name: GRPOTrainer(c, log=lambda *_: None) for name, c in configs.items()}
    log(f"{base.model}: {base.train_problems} problems x {base.group_size} samples, {base.steps} steps; tuner arms "
        f"{','.join(without)} vs + {','.join(arms)}, alternating step by step")
    rows: dict[str, list[dict]] = {name: [] for name in trainers}
    start = time.perf_counter()
    for step in range(base.steps):
        for name in rotation(list(trainers), step):  # neither run always goes first
            rows[name].append(trainers[name].train_step())
        log(f"step {step + 1:3d}  " + "  ".join(
            f"{name} rollout {rows[name][-1]['time_rollout_s']:6.2f}s accept {rows[name][-1]['acceptance_length'] or 0:.2f}"
            for name in rows))
    for trainer in trainers.values():
        trainer.close()

    def total(name, key):
        return sum(r[key] for r in rows[name])

    def speedup_by_epoch(name):  # the run without the arms' rollout time over `name`'s, epoch by epoch
        return {e: sum(rows["without"][i]["time_rollout_s"] for i in steps) /
                sum(rows[name][i]["time_rollout_s"] for i in steps) for e, steps in by_epoch.items()}

    problems = len(trainers["with"].train_examples)
    epochs = [epoch_of(i, base.prompts_per_step, problems) for i in range(base.steps)]
    buckets_of = Tuner(base.tuner)  # its buckets only
    by_epoch = {e: [i for i, x in enumerate(epochs) if x == e] for e in sorted(set(epochs))}
    result = {
        "model": base.model, "problems": base.train_problems, "group_size": base.group_size, "steps": base.steps,
        "arms_without": list(without), "arms_added": list(arms),
        "rollout_speedup": total("without", "time_rollout_s") / total("with", "time_rollout_s"),
        "step_speedup": total("without", "time_step_s") / total("with", "time_step_s"),
        "rollout_s": {name: total(name, "time_rollout_s") for name in rows},
        **({"rollout_speedup_by_tuner": {name: total("without", "time_rollout_s") / total(name, "time_rollout_s")
                                         for name in rows if name != "without"},
            "rollout_speedup_by_tuner_by_epoch": {name: speedup_by_epoch(name) for name in rows if name != "without"}}
           if tuners else {}),
        "breakdown_s": {name: {stage: total(name, f"time_{stage}_s") for stage in STAGES} for name in rows},
        "matching_steps": min(matching_steps(rows["without"], rows[name]) for name in rows if name != "without"),
        "acceptance_length": {name: [r["acceptance_length"] for r in rows[name]] for name in rows},
        "rollout_speedup_by_epoch": speedup_by_epoch("with"),
        "rollout_s_by_step": {name: [r["time_rollout_s"] for r in rows[name]] for name in rows},
        "choices_by_batch_size_with": summed_by_batch(rows["with"]),
        "choices_by_batch_size_with_by_epoch": {e: summed_by_batch([rows["with"][i] for i in steps])
                                                for e, steps in by_epoch.items()},
        "draft_sources_with": [r.get("draft_sources") for r in rows["with"]],
        "arm_rates_by_bucket_by_epoch": {name: {e: arm_rates([rows[name][i] for i in steps], buckets_of)
                                                for e, steps in by_epoch.items()} for name in rows},
        "wall_s": time.perf_counter() - start,
    }
    log(f"rollout speed-up with the suffix arms: {result['rollout_speedup']:.2f}x (whole step "
        f"{result['step_speedup']:.2f}x); steps with the same samples: {result['matching_steps']} of {base.steps}")
    for name, ratio in result.get("rollout_speedup_by_tuner", {}).items():
        log(f"  {name}: {ratio:.2f}x")
    return result
