"""Where decoding time goes: the default model's decode loop under a sampling profiler.

    pip install py-spy
    python scripts/profile_decode.py --strategy tree-d4-k2-v8 --prompts 16
    python scripts/profile_decode.py --strategy adaptive --prompts 16 --batch 16 --samples 8

runs the built-in task's eval prompts (temperature 1.0) under `py-spy record`: by default one after
another (the `tlt bench speculative` workload at batch 1); with `--batch B --samples G`, B prompts per
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


def workload(strategy: str, prompts: int, threads: int, batch: int, samples: int) -> None:
    import torch

    from tlt.bench import engine_config
    from tlt.model import load_model
    from tlt.model.checkpoint import resolve_model_path
    from tlt.rollout import RolloutEngine, SamplingParams
    from tlt.speculative import Drafter
    from tlt.tasks import ArithmeticTask
    from tlt.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    folder = resolve_model_path("default")
    model, tokenizer = load_model(folder), load_tokenizer(folder)
    drafter = None if strategy == "off" else Drafter.load("default", model)
    engine = RolloutEngine(model, config=engine_config(strategy, drafter, progress=False))
    ids = [tokenizer.encode(p.prompt) for p in ArithmeticTask().sample(prompts, seed=0, split="eval")]
    with torch.inference_mode():
        for start in range(0, len(ids), batch):
            chunk = ids[start : start + batch]
            params = [SamplingParams(n=samples, temperature=1.0, max_tokens=640, seed=start + i) for i in range(len(chunk))]
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="tree-d4-k2-v8", help="'off', 'adaptive' or a strategy name")
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
        workload(args.strategy, args.prompts, args.threads, args.batch, args.samples)
        return
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))  # or the venv's
    if spy is None:
        sys.exit("py-spy is not installed: pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(args.raw) if args.raw else Path(tmp) / "stacks.txt"
        child = [sys.executable, __file__, "--child", "--strategy", args.strategy, "--prompts", str(args.prompts),
                 "--threads", str(args.threads), "--batch", str(args.batch), "--samples", str(args.samples)]
        subprocess.run([spy, "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--", *child], check=True)
        summarize(raw, args.top)


if __name__ == "__main__":
    main()
