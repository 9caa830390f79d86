"""TRL's GRPOTrainer end to end, with its own generation and with tlt's rollout_func: what a TRL user gets.

One TRL GRPO configuration (the default model on the built-in task: `--prompts` prompts x `--samples`
samples per step, temperature 1.0, the built-in verifier as the reward) trains for `--steps` optimizer
steps once per system, each from the same weights, data order and seed:
  - `trl`: TRL's own generation (transformers' `generate`);
  - `trl+tlt_off`: `rollout_func=make_rollout_func(model, speculative="off")`, tlt's engine without
    speculation;
  - `trl+tlt`: the same with tlt's adaptive engine and the default drafter (frozen: TRL drives the
    updates, tlt only rolls out).
A callback times each optimizer step from its beginning to its end (generation, reward, log-probs,
update). The first step of every run is a warm-up and left out; each figure is the median of the other
steps. Ratios are `trl` step time / system step time. The runs go one after the other (a TRL trainer
owns its loop), so on a shared machine their order is rotated per `--repeats` round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from tlt.bench import comma_list, rotation

SYSTEMS = ("trl", "trl+tlt_off", "trl+tlt")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is a warm-up)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (TRL's num_generations)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of all systems, order rotated")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--out", default="runs/bench/trl", help="scratch folder for the trainers")


def run_system(system: str, args, folder: Path, tokenizer, dataset, out: Path) -> dict:
    import torch
    import transformers
    import trl

    from tlt.integrations import make_rollout_func
    from tlt.rewards.registry import arithmetic_reward

    transformers.set_seed(args.seed)
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    # The engine runs where the trainer does, as TRL's own generation does.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rollout = None
    if system == "trl+tlt_off":
        rollout = make_rollout_func(folder, speculative="off", seed=args.seed, device=device)
    elif system == "trl+tlt":
        rollout = make_rollout_func(folder, speculative="adaptive", drafter="default", seed=args.seed, device=device)
    times: list[float] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.start)

    config = trl.GRPOConfig(
        output_dir=str(out / system), use_cpu=device == "cpu", bf16=False, report_to="none",
        max_steps=args.steps, per_device_train_batch_size=args.prompts * args.samples, num_generations=args.samples,
        max_completion_length=args.max_tokens, temperature=1.0, learning_rate=args.lr, beta=0.0, logging_steps=1,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=args.seed,
    )
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, rollout_func=rollout, callbacks=[StepTimer()])
    trainer.remove_callback(transformers.PrinterCallback)  # the per-step log dicts; the history keeps them
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    result = {"step_times_s": times, "rewards": [h["reward"] for h in logs],
              "mean_lengths": [h.get("completions/mean_length", 0.0) for h in logs]}
    if rollout is not None:
        result["acceptance_length"] = rollout.engine.rollout_stats.acceptance_length()
    return result


def summarize(runs: list[dict]) -> dict:
    timed = [t for r in runs for t in r["step_times_s"][1:]]
    return {"median_step_s": statistics.median(timed) if timed else None, "steps_timed": len(timed),
            "runs": runs}


def run(args: argparse.Namespace) -> int:
    import torch
    from datasets import Dataset

    from tlt.errors import ConfigError
    from tlt.io import atomic_write_json
    from tlt.model.checkpoint import resolve_model_path
    from tlt.tasks import ArithmeticTask, CharTokenizer

    if args.steps < 2:
        raise ConfigError("--steps must be >= 2: the first step of a run is a warm-up")
    systems = comma_list(args.systems)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or "trl" not in systems:
        raise ConfigError(f"--systems: expected some of {list(SYSTEMS)} including trl, got {systems}")
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.disable_progress_bar()
    folder = resolve_model_path("default")
    tokenizer = CharTokenizer.from_pretrained(folder).to_transformers()
    problems = ArithmeticTask().sample(args.prompts * args.steps * 2, seed=args.seed, split="train")
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    out = Path(args.out)
    results: dict[str, list[dict]] = {s: [] for s in systems}
    print(f"trl bench: {args.prompts} prompts x {args.samples} samples, {args.steps} steps per run, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    for r in range(args.repeats):
        for system in rotation(systems, r):
            result = run_system(system, args, folder, tokenizer, dataset, out)
            results[system].append(result)
            print(f"  round {r + 1} {system:12s} steps " + " ".join(f"{t:.1f}s" for t in result["step_times_s"]),
                  file=sys.stderr)
    rows = {s: summarize(v) for s, v in results.items()}
    base = rows["trl"]["median_step_s"]
    ratios = {f"{s}_vs_trl": base / rows[s]["median_step_s"] for s in systems if s != "trl"}
    print(f"{'system':14s}  {'median step s':>13}")
    for s, row in rows.items():
        print(f"{s:14s}  {row['median_step_s']:>13.2f}")
    for k, v in ratios.items():
        print(f"{k} = {v:.2f}")
    if args.json:
        import shlex

        atomic_write_json(Path(args.json), {"config": {"command": shlex.join(sys.argv), **{
            k: v for k, v in vars(args).items() if not k.startswith("_")}, "threads": torch.get_num_threads()},
            "rows": rows, "ratios": ratios})
        print(f"wrote {args.json}")
    return 0
