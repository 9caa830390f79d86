"""Benchmarks (`tlt bench NAME`): each reports ratios measured side by side in one run, medians of
several repetitions, and can write its rows as JSON. Benchmarks are never part of the test suite."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "forward": "tlt.bench.forward",
    "rollout": "tlt.bench.rollout",
    "speculative": "tlt.bench.speculative",
    "e2e": "tlt.bench.e2e",
    "trl": "tlt.bench.trl",
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
