"""Where decoding time goes: a model's decode loop under a sampling profiler.

    pip install py-spy
    python scripts/profile_decode.py --strategy tree-d4-k2-v8 --prompts 16
    python scripts/profile_decode.py --strategy adaptive --prompts 16 --batch 16 --samples 8
    python scripts/profile_decode.py --model bench --dtype float32 --drafter-bits 4 --prompts 8

runs a task's eval prompts (temperature 1.0) under `py-spy record`; `--model` (default: the default model)
answers its own workload as the benches do (the bench policy: the bench task, its drafter and budget): by
default one after another (the `tlt bench speculative` workload at batch 1); with `--batch B --samples G`, B prompts per
`generate` call with G samples each (16 x 8 is the `tlt bench rollout` workload). `--strategy` is
`off`, `adaptive` or a strategy name. It prints, as shares of the decode steps' samples: the
time inside decoder layers (target and drafter), each line of the fused layer step (its products and
attention), and the innermost tlt line of every sample outside the layers (the Python and small
operators of drafting, verification and bookkeeping). `--raw PATH` keeps py-spy's collapsed stacks.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def workload(args: argparse.Namespace) -> None:
    import torch

    from tlt.bench import engine_config, fill_workload_defaults
    from tlt.model import load_model
    from tlt.model.checkpoint import resolve_model_path
    from tlt.rollout import RolloutEngine, SamplingParams
    from tlt.speculative import Drafter
    from tlt.speculative.strategy import Strategy
    from tlt.tasks import get_task
    from tlt.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    fill_workload_defaults(args)
    folder = resolve_model_path(args.model)
    model, tokenizer = load_model(folder, dtype=args.dtype), load_tokenizer(folder)
    model_free = args.strategy != "adaptive" and not Strategy.parse(args.strategy).uses_drafter  # off, ngram, suffix
    drafter = None if model_free else Drafter.load(args.drafter, model)
    engine = RolloutEngine(model, config=engine_config(args.strategy, drafter, progress=False,
                                                        drafter_bits=args.drafter_bits))
    ids = [tokenizer.encode(p.prompt) for p in get_task(args.task).sample(args.prompts, seed=0, split="eval")]
    batch = args.batch
    with torch.inference_mode():
        for start in range(0, len(ids), batch):
            chunk = ids[start : start + batch]
            params = [SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, seed=start + i)
                      for i in range(len(chunk))]
            engine.generate(chunk, params, use_tqdm=False)


ROOT = Path(__file__).resolve().parent.parent  # the checkout: tlt/... paths resolve against it


def frame(text: str) -> str:
    """'function (tlt/x.py:12)': py-spy's frame with the path cut to what follows the package folder."""
    return re.sub(r"\((?:[^()]*/)?(tlt|torch)/", r"(\1/", text)


def ours(text: str) -> bool:
    return frame(text).rpartition("(")[2].startswith("tlt/")


def source(text: str) -> str:
    """The source line a tlt frame points at (empty when it cannot be read)."""
    where = frame(text).rpartition("(")[2].rstrip(")")
    path, _, line = where.rpartition(":")
    try:
        return (ROOT / path).read_text().splitlines()[int(line) - 1].strip()[:72]
    except (OSError, ValueError, IndexError):
        return ""


def summarize(raw: Path, top: int) -> None:
    total = in_layers = 0
    fused_lines, outside = collections.Counter(), collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        if not any("RolloutEngine.step" in f for f in frames):
            continue  # start-up and model loading
        total += n
        if any("DecoderLayer.forward" in f for f in frames):
            in_layers += n
            for f in {f for f in frames if "fused_layer_step" in f}:
                fused_lines[frame(f)] += n
            continue
        mine = [f for f in frames if ours(f)]
        outside[frame(mine[-1] if mine else frames[-1])] += n
    if not total:
        sys.exit("no samples inside RolloutEngine.step: was the workload profiled?")
    print(f"{total} samples in decode steps; {100 * in_layers / total:.1f}% inside decoder layers")
    print("fused layer step, by line (share of all decode samples):")
    for name, n in sorted(fused_lines.items(), key=lambda kv: int(kv[0].rsplit(":", 1)[1].rstrip(")"))):
        if n >= total / 1000:
            print(f"  {100 * n / total:5.1f}%  {name}  {source(name)}")
    print(f"outside the layers, innermost tlt line (top {top}):")
    for name, n in outside.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {name}  {source(name) if ours(name) else ''}".rstrip())


def main() -> None:
    from tlt.bench import add_workload_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="tree-d4-k2-v8", help="'off', 'adaptive' or a strategy name")
    parser.add_argument("--model", default="default", help="'default', 'bench' or a model folder")
    add_workload_arguments(parser)
    parser.add_argument("--dtype", default=None, help="decode dtype (default: the model's)")
    parser.add_argument("--drafter-bits", type=int, default=16, choices=(4, 16), help="EngineConfig.drafter_bits")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    parser.add_argument("--samples", type=int, default=1, help="samples per prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rate", type=int, default=500, help="samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--raw", help="keep py-spy's collapsed stacks here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        workload(args)
        return
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))  # or the venv's
    if spy is None:
        sys.exit("py-spy is not installed: pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(args.raw) if args.raw else Path(tmp) / "stacks.txt"
        passed = {k: v for k, v in vars(args).items() if v is not None and k not in ("rate", "top", "raw", "child")}
        child = [sys.executable, __file__, "--child", *[x for k, v in passed.items()
                                                         for x in (f"--{k.replace('_', '-')}", str(v))]]
        subprocess.run([spy, "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--", *child], check=True)
        summarize(raw, args.top)


if __name__ == "__main__":
    main()
