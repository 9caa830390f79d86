"""`tlt train`: a GRPO run from a config, with periodic eval, checkpoints and exact resume.

    tlt train [--config FILE.yaml] [--out RUN_DIR] [key=value ...]
    tlt train --resume RUN_DIR [key=value ...]
The default config is the embedded default: the default model on the built-in task, adaptive
speculation with the default drafter. Every field of `TrainConfig` is a key; an unknown key or a bad
value fails before anything runs, naming the key. A resumed run reads the run's config.json (overrides
apply on top, e.g. steps=200 to extend a finished run), restores the newest complete checkpoint and
continues: its next step's metrics equal those of a run that was never interrupted.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tlt.config import build, from_dict, parse_overrides, to_dict
from tlt.errors import ConfigError
from tlt.io import atomic_write_json
from tlt.rl.config import TrainConfig


def train(config: TrainConfig, run_dir: str | Path, resume: bool = False, log=print,
          stop_after: int | None = None):
    """Run (or continue) a GRPO run in `run_dir`; returns the trainer. `stop_after` ends the process
    after that many steps of this call, as if killed (for tests of resume)."""
    from tlt.rl.checkpoint import latest_checkpoint, load_state, save_checkpoint
    from tlt.rl.metrics import MetricsLog, table_header, table_row
    from tlt.rl.trainer import GRPOTrainer

    run_dir = Path(run_dir)
    c = config
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"{run_dir} already holds a run; continue it with --resume {run_dir} or pick another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "config.json", to_dict(c))
    trainer = GRPOTrainer(c, run_dir, log)
    keep_until = None
    if resume:
        folder = latest_checkpoint(run_dir)
        if folder is not None:
            from tlt.model.checkpoint import read_tensors

            tuner_file = folder / "tuner.json"
            tuner = json.loads(tuner_file.read_text()) if tuner_file.exists() else None
            trainer.load_state_dict(load_state(folder), read_tensors(folder / "policy"), tuner)
            if (folder / "drafter").is_dir():
                trainer.load_drafter_checkpoint(folder / "drafter")
            if (folder / "drafter_buffer").is_dir():
                trainer.load_drafter_buffer(folder / "drafter_buffer")
            log(f"resumed {run_dir} from {folder.name} (step {trainer.step})")
        keep_until = trainer.step
    metrics = MetricsLog(run_dir, c.tensorboard, keep_until=keep_until,
                         wandb_project=c.wandb_project if c.wandb else None, run_config=to_dict(c))
    log(f"tlt train: {c.model} on {c.dataset or c.task}, {c.prompts_per_step} prompts x {c.group_size} samples, "
        f"speculative={c.speculative}, {c.steps} steps -> {run_dir}")
    try:
        if trainer.step == 0 and c.eval_every:
            metrics.write({"step": 0, **trainer.evaluate()})
        log(table_header())
        if metrics.rows:
            log(table_row(metrics.rows[-1]))
        done = 0
        while trainer.step < c.steps and (stop_after is None or done < stop_after):
            row = trainer.train_step()
            if c.eval_every and (trainer.step % c.eval_every == 0 or trainer.step == c.steps):
                row.update(trainer.evaluate())
            metrics.write(row)
            log(table_row(row))
            if c.save_every and (trainer.step % c.save_every == 0 or trainer.step == c.steps):
                save_checkpoint(run_dir, trainer.step, trainer.policy, trainer.tokenizer, trainer.state_dict(),
                                trainer.rollout_state(), drafter=trainer.drafter_snapshot(), keep=c.keep_checkpoints,
                                online_buffer=trainer.drafter_buffer())
            done += 1
    finally:
        metrics.close()
        trainer.close()
    trainer.metrics = metrics.rows
    return trainer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of TrainConfig fields")
    parser.add_argument("--out", help="run directory (default runs/train-<time>)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="TrainConfig fields")


def run(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config or args.out:
            raise ConfigError("--resume takes the run's own config.json; pass changes as key=value")
        path = Path(args.resume) / "config.json"
        if not path.exists():
            raise ConfigError(f"{args.resume}: not a run directory to resume (no config.json)")
        data = json.loads(path.read_text())
        data.update(parse_overrides(args.overrides))
        config = from_dict(TrainConfig, data, source=str(path))
        train(config, args.resume, resume=True)
        return 0
    config = build(TrainConfig, args.config, args.overrides)
    out = args.out or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}"
    train(config, out)
    print(f"wrote {out}")
    return 0
