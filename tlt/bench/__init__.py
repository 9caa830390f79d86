"""Benchmarks (`tlt bench NAME`): each reports ratios measured side by side in one run, medians of
several repetitions, and can write its rows as JSON. Benchmarks are never part of the test suite."""

from __future__ import annotations

import argparse
import importlib
import statistics
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from tlt.adaptive.tuner import TunerConfig
    from tlt.rollout import EngineConfig

BENCHES = {
    "forward": "tlt.bench.forward",
    "roofline": "tlt.bench.roofline",
    "rollout": "tlt.bench.rollout",
    "speculative": "tlt.bench.speculative",
    "e2e": "tlt.bench.e2e",
    "trl": "tlt.bench.trl",
    "history": "tlt.bench.history",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, module in BENCHES.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=mod.__doc__.splitlines()[0])
        mod.add_arguments(p)
        p.set_defaults(_bench=module)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(args._bench).run(args)


def engine_config(system: str, drafter: object | None = None, **fields) -> EngineConfig:
    """The EngineConfig a system name of the benchmarks and the audit stands for: "off" (plain decoding),
    "adaptive" (the tuner picks per step, with `drafter`) or a strategy name such as "tree-d4-k2-v8"
    (speculation on with that one strategy). Other `fields` are passed through."""
    from tlt.rollout import EngineConfig

    if system == "off":
        return EngineConfig(**fields)
    if system == "adaptive":
        return EngineConfig(speculative="adaptive", drafter=drafter, **fields)
    return EngineConfig(speculative="on", strategy=system, drafter=drafter, **fields)


def comma_list(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated option value."""
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_drafter_window(item: str, flag: str) -> int | str | None:
    """One drafter window of a bench flag as EngineConfig.drafter_window takes it: "auto", or an integer
    >= 0 (0: None, the whole context)."""
    from tlt.errors import ConfigError

    item = item.strip()
    if item == "auto":
        return item
    if not item.isdigit():
        raise ConfigError(f"{flag}: {item!r} is neither auto nor an integer >= 0")
    return int(item) or None


def tuner_settings(text: str, flag: str) -> tuple["TunerConfig", list[str]]:
    """One 'KEY=VALUE ...' value of a bench's tuner option (`flag`): the default TunerConfig with those settings,
    and the keys set."""
    from tlt.adaptive.tuner import TunerConfig
    from tlt.config import from_dict, parse_overrides
    from tlt.errors import ConfigError

    source = f"{flag} {text!r}"
    settings = parse_overrides(text.split(), source)
    if not settings:
        raise ConfigError(f"{source}: expected one or more KEY=VALUE settings of the tuner")
    return from_dict(TunerConfig, settings, source=source), list(settings)


def rotation(names: Sequence, repeat: int) -> list:
    """The order in which repeat `repeat` runs the systems `names`: rotated by one each repeat, so no
    system always runs first or last while the machine's speed drifts."""
    k = repeat % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def tokens_per_s(run: dict) -> float:
    return run["tokens"] / run["wall_s"]


def paired(runs: list[dict] | None, base: list[dict] | None, speed: Callable[[dict], float] = tokens_per_s) -> float | None:
    """The median over repeats of a system's `speed` over the baseline's in the same repeat (runs in
    repeat order); None without a run in every repeat (a failed system)."""
    if not runs or not base or len(runs) != len(base):
        return None
    return statistics.median(speed(r) / speed(b) for r, b in zip(runs, base))



def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """--task, --drafter and --max-tokens, whose defaults follow --model (`fill_workload_defaults`)."""
    from tlt.bench.forward import _positive_int
    from tlt.tasks import task_names

    parser.add_argument("--task", choices=task_names(), default=None,
                        help="the built-in task the prompts come from (default: bench for --model bench, else arithmetic)")
    parser.add_argument("--drafter", default=None,
                        help="drafter folder or built-in name (default: bench for --model bench, else default)")
    parser.add_argument("--max-tokens", type=_positive_int, default=None,
                        help=f"response budget (default: {MIN_MAX_TOKENS}, or the task's longest solution when longer)")


MIN_MAX_TOKENS = 640


def fill_workload_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The bench policy answers the bench task with its own drafter, every other model the built-in
    arithmetic task with the default drafter; the budget truncates no correct solution."""
    from tlt.bench_model import NAME, workload
    from tlt.tasks import get_task

    own = workload() if str(args.model) == NAME else {"task": "arithmetic", "drafter": "default"}
    for key in ("task", "drafter"):
        if getattr(args, key) is None:
            setattr(args, key, own[key])
    if args.max_tokens is None:
        args.max_tokens = max(MIN_MAX_TOKENS, get_task(args.task).config.max_solution_tokens)
    return args


def baseline_name(baseline_dtype: str | None, dtype: str) -> str | None:
    """The name of the plain-decoding system `--baseline-dtype` adds (`off_<dtype>`), or None when it
    adds none: not given, or the dtype every other system already runs."""
    return None if baseline_dtype is None or baseline_dtype == dtype else f"off_{baseline_dtype}"
