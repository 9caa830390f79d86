"""The `tlt` command line: one subcommand per task, each implemented in the module that owns it.

Subcommands register through `COMMANDS`: name -> (module path, help). The module provides
`add_arguments(parser)` and `run(args) -> int`. Command modules keep heavy imports (torch,
transformers, matplotlib) inside their functions, so building the parser stays fast and a broken
optional dependency only affects its own command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tlt.errors import TltError

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tlt.demo", "run the embedded default end to end"),
    "sft": ("tlt.sft", "train the default model by supervised fine-tuning on the built-in task"),
    "eval": ("tlt.evaluate", "accuracy of a model on fresh problems of the built-in task"),
    "train": ("tlt.rl.run", "GRPO training with adaptive speculative rollout (the embedded default without arguments)"),
    "bench": ("tlt.bench", "benchmarks: forward, roofline, rollout, speculative, e2e, history, trl"),
    "train-drafter": ("tlt.speculative.train", "train an EAGLE drafter offline on the target's own generations"),
    "export-drafter": ("tlt.speculative.export", "write a drafter as an EAGLE draft head for SGLang and vLLM"),
    "report": ("tlt.report", "figures and a markdown summary of a GRPO run directory"),
    "audit": ("tlt.audit", "statistical check that speculative sampling is lossless on your model, drafter and settings"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def line_buffered_output() -> None:
    """Print whole lines as they come when stdout is a file or a pipe (a long job run under nohup or
    tee), not in blocks of kilobytes, which would keep a long job's log empty for minutes."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None and not sys.stdout.isatty():
        reconfigure(line_buffering=True)


def main(argv: list[str] | None = None) -> int:
    line_buffered_output()
    args = build_parser().parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except TltError as exc:
        print(f"tlt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tlt {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
