"""`tlt train`: a GRPO run from a config, with periodic eval, checkpoints and exact resume.

    tlt train [--config FILE.yaml] [--out RUN_DIR] [key=value ...]
    tlt train --resume RUN_DIR [key=value ...]
    tlt train --help-config
The default config is the embedded default: the default model on the built-in task, adaptive
speculation with the default drafter. Every field of `TrainConfig` is a key, dotted within a group
(`drafter.lr=1e-4`; `--help-config` lists them); an unknown key or a bad value fails before anything
runs, naming the key. A resumed run reads the run's config.json, whichever release wrote it (overrides
apply on top, e.g. steps=200 to extend a finished run), restores the newest checkpoint that reads
whole (an older one, with a warning, when a file of the newest is torn) and continues: its next step's
metrics equal those of a run that was never interrupted. Before any file of the run directory is
written, the config is checked, the model's config and tokenizer load, every training and eval prompt
is encoded and checked against the model's context, and the checkpoint is read.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tlt.config import build, compose, describe, parse_overrides, to_dict, upgrade
from tlt.errors import ConfigError
from tlt.io import atomic_write_json
from tlt.rl.config import TrainConfig


def train(config: TrainConfig, run_dir: str | Path, resume: bool = False, log=print,
          stop_after: int | None = None):
    """Run (or continue) a GRPO run in `run_dir`; returns the trainer. `stop_after` ends the process
    after that many steps of this call, as if killed (for tests of resume). Nothing in `run_dir` is
    written until the trainer has loaded the model, the data and the checkpoint: a run that cannot
    start leaves the directory as it was."""
    from tlt.rl.checkpoint import save_checkpoint
    from tlt.rl.metrics import MetricsLog, table_header, table_row
    from tlt.rl.trainer import GRPOTrainer

    run_dir = Path(run_dir)
    c = config
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: is a file; a run directory is a folder (a new one, or a run's to resume)")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.exists() and not checkpoints.is_dir():
        other = "" if resume else ", or pick another --out"
        raise ConfigError(f"{checkpoints}: is a file; a run keeps its checkpoints in a folder of that name (move or "
                          f"rename the file{other})")
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"{run_dir} already holds a run; continue it with --resume {run_dir} or pick another --out")
    if not resume and checkpoints.exists():  # a new run would write its step folders over these
        raise ConfigError(f"{run_dir} already holds checkpoints ({checkpoints}); continue that run with --resume "
                          f"{run_dir} or pick another --out")
    trainer = GRPOTrainer(c, run_dir, log)
    metrics = None
    try:
        keep_until = resume_from_checkpoint(trainer, run_dir, log) if resume else None
        metrics = MetricsLog(run_dir, c.log.tensorboard, keep_until=keep_until,
                             wandb_project=c.log.wandb_project if c.log.wandb else None, run_config=to_dict(c), log=log)
        atomic_write_json(run_dir / "config.json", to_dict(c))
        log(f"tlt train: {c.model} on {c.dataset or c.task}, {c.prompts_per_step} prompts x {c.group_size} samples, "
            f"speculative={c.speculative}, {c.steps} steps -> {run_dir}")
        if trainer.step == 0 and c.eval.every:
            metrics.write({"step": 0, **trainer.evaluate()})
        if trainer.step >= c.steps:
            log(f"the run is at step {trainer.step}, and steps={c.steps}: nothing to train (pass steps=N to extend it)")
        log(table_header())
        if metrics.rows:
            log(table_row(metrics.rows[-1]))
        done = 0
        while trainer.step < c.steps and (stop_after is None or done < stop_after):
            row = trainer.train_step()
            if c.eval.every and (trainer.step % c.eval.every == 0 or trainer.step == c.steps):
                row.update(trainer.evaluate())
            metrics.write(row)
            log(table_row(row))
            if c.save_every and (trainer.step % c.save_every == 0 or trainer.step == c.steps):
                save_checkpoint(run_dir, trainer.step, trainer.policy, trainer.tokenizer, trainer.state(),
                                trainer.drafting_states(), drafter=trainer.drafter_snapshot(), keep=c.keep_checkpoints,
                                online_buffer=trainer.drafter_buffer())
            done += 1
    finally:
        if metrics is not None:
            metrics.close()
        trainer.close()
    trainer.metrics = metrics.rows
    return trainer


def resume_from_checkpoint(trainer, run_dir: Path, log=print) -> int:
    """Restore the newest checkpoint of `run_dir` that reads whole into `trainer`, falling back to older
    ones with a warning; returns the step it resumes from (0: the run had no checkpoint yet)."""
    from tlt.errors import CheckpointError
    from tlt.rl.checkpoint import checkpoints_newest_first, read_checkpoint, remove_partial_checkpoints

    folders = checkpoints_newest_first(run_dir)
    problems = []
    for folder in folders:
        try:
            trainer.restore(read_checkpoint(folder))
        except CheckpointError as exc:
            problems.append(str(exc))
            log(f"warning: cannot resume from {folder.name}: {exc}")
            continue
        if problems:
            log(f"warning: resuming from {folder.name}, the newest checkpoint that reads whole; "
                f"the steps after it run again")
        log(f"resumed {run_dir} from {folder.name} (step {trainer.step})")
        remove_partial_checkpoints(run_dir)
        return trainer.step
    if folders:
        raise CheckpointError(f"{run_dir}: none of its {len(folders)} checkpoints can be read (newest: {problems[0]}); "
                              f"start a new run with --out, or restore the checkpoints folder")
    remove_partial_checkpoints(run_dir)
    log(f"warning: {run_dir} has no checkpoint (none written yet, or save_every=0): the run starts again from step 0")
    return trainer.step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of TrainConfig fields")
    parser.add_argument("--out", help="run directory (default runs/train-<time>)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
    parser.add_argument("--help-config", action="store_true",
                        help="list every key (dotted within its group) with its default and meaning, and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="TrainConfig fields")


# Settings a run's config.json may hold that TrainConfig no longer has: dropped on resume while unset (a set
# one still fails, naming the key).
RETIRED_KEYS = ("drafter_fault",)


def resume_config(run_dir: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """The config of the run in `run_dir` (its config.json), with `key=value` overrides on top."""
    from tlt.model.checkpoint import read_json

    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{run_dir}: not a run directory to resume (no config.json)")
    data = upgrade(TrainConfig, read_json(path))
    for key in RETIRED_KEYS:  # run folders written before a setting was retired still resume
        if data.get(key) is None:
            data.pop(key, None)
    return compose(TrainConfig, [(data, str(path)), (parse_overrides(list(overrides)), "command line")])


def run(args: argparse.Namespace) -> int:
    if args.help_config:
        print("\n".join(describe(TrainConfig)))
        return 0
    if args.resume:
        if args.config or args.out:
            raise ConfigError("--resume takes the run's own config.json; pass changes as key=value")
        train(resume_config(args.resume, args.overrides), args.resume, resume=True)
        return 0
    config = build(TrainConfig, args.config, args.overrides)
    out = args.out or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}"
    train(config, out)
    print(f"wrote {out}")
    return 0
