"""`tlt report`: the figures and a markdown summary of a GRPO run, read from its run directory.

    tlt report RUN_DIR [--out DIR] [--compare OTHER_RUN_DIR [--labels A B]]

Only `metrics.jsonl` and `config.json` are read (see tlt/rl/checkpoint.py for the layout), so a report
can be drawn for a run still in progress: a torn last line, the one a live run may be appending, is
left out. Rows with `reward` are training steps; rows with `eval_accuracy` are evals (step 0 is an
eval-only row). Written into RUN_DIR/report/ unless --out is given:

    learning.png      reward and train accuracy per step, eval accuracy (sampled and greedy) on the same axes
    lengths.png       response-length histogram per step: step on x, log-spaced length bins on y
    step_time.png     the step time stacked by stage (rollout, reward, logprob, update, sync, drafter)
    acceptance.png    acceptance length per step; not drawn when the run did not speculate
    strategies.png    the strategy the rollout ran, as a fraction of decode steps per live-batch-size bin
    compare_learning.png, compare_step_time.png   with --compare: both runs on one plot each
    report.md         config highlights, accuracy, step-time breakdown, lengths, links to the figures
Every file is written atomically. A missing figure is named in report.md with the reason.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from tlt.errors import ConfigError
from tlt.io import atomic_write_bytes

STAGES = ("rollout", "reward", "logprob", "update", "sync", "drafter")
FIGSIZE = (8, 4.5)
DPI = 120
CONFIG_HIGHLIGHTS = ("model", "dataset", "task", "reward", "speculative", "strategy", "drafter.model",
                     "prompts_per_step", "group_size", "max_response_tokens", "temperature", "optim.lr", "steps", "seed")


class Run:
    """The rows and config (dotted keys) of one run directory; `label` names it in legends."""

    def __init__(self, run_dir: str | Path, label: str | None = None) -> None:
        from tlt.config import upgrade
        from tlt.model.checkpoint import read_json
        from tlt.rl.config import TrainConfig

        self.dir = Path(run_dir)
        self.label = label or self.dir.name
        self.rows = read_rows(self.dir / "metrics.jsonl")
        path = self.dir / "config.json"
        self.config = upgrade(TrainConfig, read_json(path)) if path.exists() else {}
        self.train = [r for r in self.rows if "reward" in r]
        self.evals = [r for r in self.rows if "eval_accuracy" in r]

    def series(self, key: str, rows: list[dict] | None = None) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows (training rows by default) that have a number under `key`."""
        pairs = [(r["step"], r[key]) for r in (self.train if rows is None else rows)
                 if isinstance(r.get(key), (int, float))]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def speculated(self) -> bool:
        return bool(self.series("acceptance_length")[0])


def read_rows(path: Path) -> list[dict]:
    from tlt.rl.metrics import read_metrics

    if not path.exists():
        raise ConfigError(f"{path.parent}: not a run directory to report on (no metrics.jsonl)")
    rows = read_metrics(path, note=lambda message: print(f"tlt report: {message}", file=sys.stderr))
    if not rows:
        raise ConfigError(f"{path}: no metrics rows yet")
    return rows


# --- figures ---------------------------------------------------------------------------------------
def _axes(title: str, xlabel: str, ylabel: str):
    from tlt.plots import pyplot

    fig, ax = pyplot().subplots(figsize=FIGSIZE)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    return fig, ax


def _save(fig, path: Path) -> Path:
    from tlt.plots import save

    return save(fig, path, dpi=DPI)


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def learning_figure(run: Run, path: Path) -> Path:
    fig, ax = _axes(f"{run.label}: reward and accuracy", "step (policy updates)", "reward / accuracy")
    ax.plot(*run.series("reward"), label="reward (train)", color="#3b6ea5")
    ax.plot(*run.series("accuracy"), label="accuracy (train)", color="#3b6ea5", linestyle=":")
    ax.plot(*run.series("eval_accuracy", run.evals), "o-", label="eval accuracy (sampled)", color="#c0392b")
    ax.plot(*run.series("eval_greedy_accuracy", run.evals), "s--", label="eval accuracy (greedy)", color="#e67e22")
    _integer_steps(ax)
    ax.legend(loc="best")
    return _save(fig, path)


def length_figure(run: Run, path: Path, bins: int = 40) -> Path:
    """A heatmap of response-length counts: one column per step, log-spaced integer length bins."""
    from matplotlib.ticker import FormatStrFormatter

    steps = [r["step"] for r in run.train if r.get("response_lengths")]
    lengths = [np.maximum(np.asarray(r["response_lengths"]), 1) for r in run.train if r.get("response_lengths")]
    top = max(int(a.max()) for a in lengths)
    # Bin i holds the integer lengths edges[i] + 0.5 .. edges[i+1] - 0.5, so a length drawn as a line
    # (median, max) falls inside its own bin, not on a border.
    edges = np.unique(np.round(np.geomspace(1, top + 1, bins + 1))) - 0.5
    counts = np.stack([np.histogram(a, edges)[0] for a in lengths], axis=1)  # [bins, steps]
    fig, ax = _axes(f"{run.label}: response lengths per step", "step (policy updates)", "response length (tokens)")
    x = np.concatenate([np.asarray(steps) - 0.5, [steps[-1] + 0.5]])
    mesh = ax.pcolormesh(x, edges, np.ma.masked_equal(counts, 0), cmap="viridis", shading="flat")
    ax.plot(steps, [np.median(a) for a in lengths], color="black", linewidth=1.5, label="median")
    ax.plot(steps, [a.max() for a in lengths], color="#c0392b", linewidth=1.5, linestyle="--", label="max")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.set_facecolor("#f4f4f4")  # empty bins are masked: they show this, not the colour of a count
    ax.grid(False)
    _integer_steps(ax)
    fig.colorbar(mesh, ax=ax, label="responses")
    ax.legend(loc="lower right")
    return _save(fig, path)


def step_time_figure(run: Run, path: Path) -> Path:
    steps = [r["step"] for r in run.train]
    fig, ax = _axes(f"{run.label}: step time by stage", "step (policy updates)", "seconds")
    bottom = np.zeros(len(steps))
    width = 0.9 if len(steps) < 200 else 1.0
    for stage in STAGES:
        values = np.array([r.get(f"time_{stage}_s", 0.0) for r in run.train])
        ax.bar(steps, values, bottom=bottom, width=width, label=stage)
        bottom += values
    _integer_steps(ax)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def acceptance_figure(run: Run, path: Path) -> Path:
    fig, ax = _axes(f"{run.label}: acceptance length", "step (policy updates)",
                    "tokens per row per speculative step")
    ax.plot(*run.series("acceptance_length"), "o-", color="#3b6ea5", label="acceptance length")
    ax.axhline(1.0, color="grey", linestyle=":", label="1 (no draft accepted)")
    _integer_steps(ax)
    ax.legend(loc="best")
    return _save(fig, path)


def summed_by_batch(rows: list[dict], key: str = "strategy_by_batch") -> dict[int, dict[str, float]]:
    """The metric rows' `key` tables (live batch size -> strategy -> decode steps, `time_decode_by_batch_s`'s
    seconds or `tokens_by_batch`'s tokens) summed, batch sizes ascending; rows without the table add nothing."""
    total: dict[int, dict[str, float]] = {}
    for row in rows:
        for size, by_name in (row.get(key) or {}).items():
            slot = total.setdefault(int(size), {})
            for name, value in by_name.items():
                slot[name] = slot.get(name, 0) + value
    return dict(sorted(total.items()))


def strategy_counts(run: Run) -> dict[int, dict[str, int]]:
    """Decode steps per live batch size and strategy, summed over the run's training steps."""
    return summed_by_batch(run.train)


def power_bins(table: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """A table of `summed_by_batch` summed into power-of-two bins of batch sizes: k -> the sizes [2^k, 2^(k+1))."""
    bins: dict[int, dict[str, float]] = {}
    for size, by_name in table.items():
        slot = bins.setdefault(int(math.log2(max(size, 1))), {})
        for name, value in by_name.items():
            slot[name] = slot.get(name, 0) + value
    return bins


def strategy_figure(run: Run, path: Path) -> Path:
    """Batch sizes are grouped into power-of-two bins [2^k, 2^(k+1)), one bar each, so bars never overlap
    on the log axis; each bar is stacked by the fraction of that bin's decode steps per strategy."""
    from matplotlib.ticker import FormatStrFormatter

    bins = power_bins(strategy_counts(run))
    names = sorted({n for c in bins.values() for n in c}, key=lambda n: (n != "off", n))
    ks = sorted(bins)
    lefts, widths = [2.0 ** k for k in ks], [2.0 ** k for k in ks]
    totals = np.array([sum(bins[k].values()) for k in ks])
    fig, ax = _axes(f"{run.label}: strategy by live batch size", "live batch size (power-of-two bins)",
                    "fraction of decode steps")
    bottom = np.zeros(len(ks))
    for name in names:
        share = np.array([bins[k].get(name, 0) for k in ks]) / totals
        ax.bar(lefts, share, width=widths, bottom=bottom, align="edge", edgecolor="white", label=name)
        bottom += share
    for left, width, n in zip(lefts, widths, totals):
        ax.text(left * math.sqrt(2), 1.01, str(n), ha="center", va="bottom", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.set_ylim(0, 1.08)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="strategy")
    ax.text(0.0, -0.2, "numbers above bars: decode steps in the bin", transform=ax.transAxes, fontsize=8)
    return _save(fig, path)


# Runs that learn the same draw the same curves: the first run goes underneath, wide and pale, so
# both stay visible where they coincide.
_RUN_STYLES = (dict(color="#3b6ea5", linewidth=4.0, alpha=0.5, markersize=10),
               dict(color="#c0392b", linewidth=1.5, alpha=1.0, markersize=5))


def compare_learning_figure(runs: list[Run], path: Path) -> Path:
    fig, ax = _axes("reward and eval accuracy", "step (policy updates)", "reward / accuracy")
    for run, style in zip(runs, _RUN_STYLES):
        ax.plot(*run.series("reward"), label=f"{run.label}: reward", **style)
        ax.plot(*run.series("eval_accuracy", run.evals), "o--", label=f"{run.label}: eval accuracy", **style)
    _integer_steps(ax)
    ax.legend(loc="best")
    return _save(fig, path)


def compare_step_time_figure(runs: list[Run], path: Path) -> Path:
    fig, ax = _axes("step time", "step (policy updates)", "seconds")
    for run, style in zip(runs, _RUN_STYLES):
        ax.plot(*run.series("time_step_s"), label=f"{run.label}: whole step", **style)
        ax.plot(*run.series("time_rollout_s"), linestyle=":", label=f"{run.label}: rollout", **style)
    _integer_steps(ax)
    ax.set_ylim(bottom=0)
    ax.legend(loc="best")
    return _save(fig, path)


# --- the summary -----------------------------------------------------------------------------------
def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _fmt(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _eval_lines(run: Run) -> list[str]:
    if not run.evals:
        return ["No eval rows (eval.every=0)."]
    lines = ["| metric | first | last | best (step) |", "|---|---|---|---|"]
    keys = ["eval_accuracy", "eval_greedy_accuracy"] + sorted({k for r in run.evals for k in r if k.startswith("eval_pass@")})
    for key in keys:
        steps, values = run.series(key, run.evals)
        if values:
            best = int(np.argmax(values))
            lines.append(f"| {key} | {values[0]:.3f} (step {steps[0]}) | {values[-1]:.3f} (step {steps[-1]}) "
                         f"| {values[best]:.3f} ({steps[best]}) |")
    return lines


def _time_lines(run: Run) -> list[str]:
    total = _mean(run.series("time_step_s")[1])
    if total is None:
        return ["No training steps yet."]
    lines = [f"Mean step time {total:.3f} s over {len(run.train)} steps.", "",
             "| stage | mean s | share |", "|---|---|---|"]
    for stage in STAGES:
        mean = _mean(run.series(f"time_{stage}_s")[1]) or 0.0
        lines.append(f"| {stage} | {mean:.3f} | {100 * mean / total if total else 0.0:.1f}% |")
    eval_time = _mean(run.series("eval_time_s", run.evals)[1])
    if eval_time is not None:
        lines += ["", f"Eval (not part of the step time) took {eval_time:.3f} s on average."]
    return lines


def _length_lines(run: Run) -> list[str]:
    every = [n for r in run.train for n in r.get("response_lengths") or []]
    if not every:
        return ["No response lengths recorded."]
    a = np.asarray(every)
    first, last = run.train[0], run.train[-1]
    truncated = _mean(run.series("truncated_fraction")[1])
    return [f"Over all {len(a)} responses: mean {a.mean():.1f}, p50 {np.percentile(a, 50):.0f}, "
            f"p90 {np.percentile(a, 90):.0f}, p99 {np.percentile(a, 99):.0f}, max {a.max()} tokens; "
            f"{100 * (truncated or 0.0):.1f}% hit max_response_tokens on average.",
            f"Mean length at step {first['step']}: {_fmt(first.get('response_length_mean'), 1)}; "
            f"at step {last['step']}: {_fmt(last.get('response_length_mean'), 1)}."]


def _strategy_mix(run: Run) -> str:
    totals: dict[str, int] = {}
    for by_name in strategy_counts(run).values():
        for name, n in by_name.items():
            totals[name] = totals.get(name, 0) + n
    steps = sum(totals.values())
    if not steps:
        return "no decode steps recorded."
    shares = sorted(totals.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {100 * n / steps:.1f}%" for name, n in shares) + f" of {steps} decode steps."


def _rate_lines(run: Run) -> list[str]:
    """Decode tokens a second per strategy and live batch size bin [2^k, 2^(k+1)) (the strategy figure's), over
    the steps the run gave each: what each arm earned where it ran. Empty for runs whose metrics hold no
    per-batch decode times."""
    seconds = power_bins(summed_by_batch(run.train, "time_decode_by_batch_s"))
    tokens = power_bins(summed_by_batch(run.train, "tokens_by_batch"))
    if not seconds:
        return []
    spent: dict[str, float] = {}
    for by_arm in seconds.values():
        for arm, t in by_arm.items():
            spent[arm] = spent.get(arm, 0.0) + t
    arms = sorted(spent, key=lambda a: -spent[a])
    lines = ["Decode tokens a second by live rows, per strategy where the run used it:", "",
             "| live rows | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for k in sorted(seconds):
        cells = [f"{tokens[k][a] / seconds[k][a]:.0f}" if seconds[k].get(a) else "-" for a in arms]
        label = "1" if k == 0 else f"{2 ** k}-{2 ** (k + 1) - 1}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def summary(run: Run, figures: dict[str, str], skipped: dict[str, str], compare: Run | None = None) -> str:
    """report.md: `figures` maps a caption to a PNG file name, `skipped` a caption to why it is missing."""
    c = run.config
    lines = [f"# Run report: {run.label}", "", f"Run directory: `{run.dir}`", "", "## Config", "",
             "| field | value |", "|---|---|"]
    # A run on a user dataset has the built-in task's default in config.json, but never read it.
    shown = [k for k in CONFIG_HIGHLIGHTS if c.get(k) is not None and not (k == "task" and c.get("dataset"))]
    lines += [f"| {k} | {c[k]} |" for k in shown]
    if not c:
        lines.append("| (config.json missing) | |")
    done = run.train[-1]["step"] if run.train else 0
    lines += ["", f"Steps done: {done}" + (f" of {c['steps']}" if "steps" in c else "") + ".", "",
              "## Eval accuracy", "", *_eval_lines(run), "",
              "## Step time", "", *_time_lines(run), "",
              "## Response lengths", "", *_length_lines(run), "",
              "## Speculation", ""]
    if run.speculated():
        accept = run.series("acceptance_length")[1]
        lines.append(f"Mean acceptance length {np.mean(accept):.2f} tokens per row per speculative step "
                     f"(first {accept[0]:.2f}, last {accept[-1]:.2f}).")
    else:
        lines.append(f"The run did not speculate (speculative={c.get('speculative', '?')}): no acceptance length.")
    lines += ["", "Strategy mix: " + _strategy_mix(run), "", *_rate_lines(run)]
    if compare is not None:
        lines += ["## Comparison", "", f"`{run.label}` (`{run.dir}`) against `{compare.label}` (`{compare.dir}`).", "",
                  "| | " + " | ".join(r.label for r in (run, compare)) + " |", "|---|---|---|"]
        measures = (("mean step time s", lambda r: _mean(r.series("time_step_s")[1])),
                    ("mean rollout time s", lambda r: _mean(r.series("time_rollout_s")[1])),
                    ("mean reward", lambda r: _mean(r.series("reward")[1])),
                    ("last eval accuracy", lambda r: (r.series("eval_accuracy", r.evals)[1] or [None])[-1]))
        lines += [f"| {name} | {_fmt(measure(run))} | {_fmt(measure(compare))} |" for name, measure in measures]
        a, b = (_mean(r.series("time_step_s")[1]) for r in (run, compare))
        if a and b:
            lines += ["", f"Mean step time {run.label} / {compare.label}: {a / b:.2f}x."]
        lines.append("")
    lines += ["## Figures", ""]
    for caption, name in figures.items():
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    for caption, why in skipped.items():
        lines += [f"- {caption}: not drawn ({why})."]
    return "\n".join(lines).rstrip() + "\n"


def write_report(run_dir: str | Path, out: str | Path | None = None, compare: str | Path | None = None,
                 labels: tuple[str, str] | None = None) -> Path:
    """Draw the figures and write report.md for the run in `run_dir` (and `compare`, when given) into
    `out` (default RUN_DIR/report); returns the path of report.md."""
    names = labels or (None, None)
    run = Run(run_dir, names[0])
    other = Run(compare, names[1]) if compare is not None else None
    if other is not None and labels is None and other.label == run.label:  # e.g. two runs/*/off
        run.label, other.label = str(run.dir), str(other.dir)
    out = Path(out) if out is not None else run.dir / "report"
    figures: dict[str, str] = {}
    skipped: dict[str, str] = {}

    def draw(caption: str, name: str, make, *args) -> None:
        figures[caption] = make(*args, out / name).name

    if run.train or run.evals:
        draw("Reward and accuracy", "learning.png", learning_figure, run)
    if any(r.get("response_lengths") for r in run.train):
        draw("Response lengths per step", "lengths.png", length_figure, run)
    else:
        skipped["Response lengths per step"] = "no training step recorded its response lengths"
    if run.train:
        draw("Step time by stage", "step_time.png", step_time_figure, run)
    else:
        skipped["Step time by stage"] = "no training steps yet"
    if run.speculated():
        draw("Acceptance length", "acceptance.png", acceptance_figure, run)
    else:
        skipped["Acceptance length"] = "the run did not speculate"
    if any(name != "off" for by_name in strategy_counts(run).values() for name in by_name):
        draw("Strategy by live batch size", "strategies.png", strategy_figure, run)
    else:
        skipped["Strategy by live batch size"] = "every decode step was plain decoding"
    if other is not None:
        draw("Comparison: reward and eval accuracy", "compare_learning.png", compare_learning_figure, [run, other])
        draw("Comparison: step time", "compare_step_time.png", compare_step_time_figure, [run, other])
    path = out / "report.md"
    atomic_write_bytes(path, summary(run, figures, skipped, other).encode())
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by tlt train")
    parser.add_argument("--out", help="folder for the PNGs and report.md (default RUN_DIR/report)")
    parser.add_argument("--compare", metavar="OTHER_RUN_DIR", help="a second run to draw on the same plots")
    parser.add_argument("--labels", nargs=2, metavar=("A", "B"), help="legend names of RUN_DIR and OTHER_RUN_DIR")


def run(args: argparse.Namespace) -> int:
    if args.labels and not args.compare:
        raise ConfigError("--labels names the two runs of --compare; give --compare OTHER_RUN_DIR too")
    path = write_report(args.run_dir, args.out, args.compare, tuple(args.labels) if args.labels else None)
    print(f"wrote {path} and its figures")
    return 0
