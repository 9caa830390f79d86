"""The bench policy and its drafter: the workload on which tlt's speed is judged, built into a cache.

The default model (3 M parameters) fits this CPU's L3 cache, so its decode is bound by per-operator
cost, not by streaming weights as a real policy's is. The bench policy (`tlt sft --preset bench`,
~92 M parameters, 12 layers, ~184 MB in bf16: the default model grown to that shape, then trained)
streams from memory at batch 1 and answers the `bench` task (reasoning-length chains); its EAGLE drafter comes from the `tlt train-drafter` recipe on its own
samples of that task. Both are too large for git, so `make bench-model` (`python -m tlt.bench_model`)
builds them into `cache_folder()`:

    $TLT_CACHE/bench/                 (TLT_CACHE defaults to ${XDG_CACHE_HOME:-~/.cache}/tlt)
        config.json, model.safetensors, char_tokenizer.json, recipe.json    the policy
        drafter/                                                            its drafter, first stage
        drafter-unrolled/   the drafter fine-tuned on its own features (unroll=3): the bench drafter
        .stage-NAME.json    one per finished stage (policy, drafter, unrolled) with the hash of what it depends on: an
                            interrupted build resumes at the stage it was in
        bench_recipe.json   the recipe, its hash and the commands that ran; written last, so its
                            presence with the current recipe's hash means a complete, current build

A build whose recipe hash matches is reused; otherwise each stage whose own hash changed is rebuilt (a
changed drafter command keeps the policy; a changed policy rebuilds all). `bench` as a
model or drafter name (`--model bench`, `model=bench`, `drafter.model=bench`) resolves here, and fails with
a message naming `make bench-model` while the build is missing, incomplete or from another recipe.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tlt.errors import CheckpointError

NAME = "bench"
STAMP = "bench_recipe.json"
DRAFTER = "{out}/drafter-unrolled"  # the bench drafter: the last stage's output
# Commands run in order; {out} is the cache folder. On 2 Xeon cores with AMX: the policy 15 minutes, the drafter
# 24 and its unrolled fine-tuning about 20 (both drafter stages mostly collecting the policy's responses).
COMMANDS = (
    ("policy", ["sft", "--preset", "bench", "--out", "{out}"]),
    ("drafter", ["train-drafter", "--model", "{out}", "--out", "{out}/drafter", "--task", "bench",
                 "--prompts", "128", "--samples", "4", "--max-tokens", "1600", "--eval-prompts", "8",
                 "steps=1500", "batch_tokens=2048", "rows=4", "window=512", "threads=2", "log_every=100"]),
    # Three training-time-test rounds on the same samples: deep tree levels read the drafter's own features
    # (held-out acceptance of tree-d6-k2-v8 4.23 -> 4.43, tree-d4-k2-v8 3.80 -> 3.88).
    ("unrolled", ["train-drafter", "--model", "{out}", "--from-drafter", "{out}/drafter", "--out", DRAFTER,
                  "--task", "bench", "--prompts", "128", "--samples", "4", "--max-tokens", "1600",
                  "--eval-prompts", "8", "steps=300", "batch_tokens=2048", "rows=4", "window=512", "unroll=3",
                  "lr=3e-4", "warmup_steps=20", "threads=2", "log_every=50"]),
)


def workload() -> dict[str, str | int]:
    """What a bench of the bench policy runs by default: its task, its drafter and, as response budget,
    the task's longest solution."""
    from tlt.tasks import get_task

    return {"task": NAME, "drafter": NAME, "max_tokens": get_task(NAME).config.max_solution_tokens}


def cache_root() -> Path:
    """$TLT_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/tlt."""
    if os.environ.get("TLT_CACHE"):
        return Path(os.environ["TLT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "tlt"


def cache_folder() -> Path:
    return cache_root() / NAME


def recipe() -> dict:
    """Everything the build depends on: the SFT preset, the precision its training runs in on this CPU, the
    weights it grows from, the task's fields and the commands."""
    from tlt.device import slow_cpu_bf16
    from tlt.model.checkpoint import resolve_model_path
    from tlt.sft import PRESETS
    from tlt.tasks import NAMED_TASKS

    preset = PRESETS["bench"]
    weights = resolve_model_path(preset["init"]) / "model.safetensors"
    r = {"sft_preset": preset, "task": list(NAMED_TASKS["bench"]),
         "init_weights": hashlib.sha256(weights.read_bytes()).hexdigest()[:16],
         "commands": {name: ["tlt", *args] for name, args in COMMANDS}}
    # `tlt sft` trains in float32 where bf16 autocast has no bf16 products (AVX2 only): another policy, so another
    # build, and a cache copied between such machines is rebuilt rather than taken for the other's. Recorded only
    # then, so the builds where the preset's autocast runs keep their hash.
    if preset.get("autocast") and slow_cpu_bf16():
        r["policy_autocast"] = False
    return r


def recipe_hash(r: dict) -> str:
    return hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:16]


def stage_hash(r: dict, name: str) -> str:
    """The hash of what stage `name` depends on: the recipe with its commands up to and including that
    stage's, so a changed drafter command rebuilds the drafter stages from it on and keeps the policy,
    while a changed policy rebuilds all."""
    names = [n for n, _ in COMMANDS]
    upto = names[: names.index(name) + 1]
    return recipe_hash({**r, "commands": {n: c for n, c in r["commands"].items() if n in upto}})


def stamp(folder: Path) -> dict | None:
    """The folder's bench_recipe.json, None when missing or unreadable."""
    try:
        data = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def stage_record(folder: Path, name: str) -> dict | None:
    """The record of build stage `name` finished in `folder`, None when it has not finished."""
    try:
        data = json.loads((folder / f".stage-{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "step" in data else None


def is_current(folder: Path, r: dict | None = None) -> bool:
    """True when `folder` holds a complete build of recipe `r` (the current recipe when None)."""
    s = stamp(folder)
    return s is not None and s.get("hash") == recipe_hash(r if r is not None else recipe())


def built_folder(what: str = "model") -> Path:
    """The cache folder when it holds a complete build of the current recipe; else a CheckpointError
    naming `make bench-model`."""
    folder = cache_folder()
    s = stamp(folder)
    if s is None:
        why = "is not built" if not folder.exists() else "is incomplete (a build is running or was interrupted)"
    elif s.get("hash") != recipe_hash(recipe()):
        why = f"was built from another recipe (hash {s.get('hash')}, current {recipe_hash(recipe())})"
    else:
        return folder
    raise CheckpointError(f"the bench {what} at {folder} {why}: run `make bench-model` (an hour to 2 hours on 2 cores; "
                          f"TLT_CACHE sets the cache folder)")


def model_folder() -> Path:
    return built_folder("model")


def drafter_folder() -> Path:
    return Path(DRAFTER.replace("{out}", str(built_folder("drafter"))))


def build(folder: Path | None = None, force: bool = False, run=subprocess.run, log=print) -> bool:
    """Build the policy, then its drafter and the drafter's unrolled fine-tuning, into `folder` (the cache
    folder) unless it holds a current build; `run(argv, check=True)` runs each command. Returns True when it built."""
    folder = folder or cache_folder()
    r = recipe()
    if is_current(folder, r) and not force:
        log(f"bench model: {folder} holds the current recipe ({recipe_hash(r)}); reused")
        return False
    from tlt.io import atomic_write_json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / STAMP).unlink(missing_ok=True)
    ran, start = [], time.time()
    for name, args in COMMANDS:
        argv = [a.replace("{out}", str(folder)) for a in args]
        done, h = stage_record(folder, name), stage_hash(r, name)
        if done is not None and done.get("hash") == h and not force:
            log(f"bench model: {name}: kept from an earlier build of this recipe ({done.get('seconds')} s)")
            ran.append(done["step"])
            continue
        log(f"bench model: {name}: tlt {' '.join(argv)}")
        t0 = time.time()
        run([sys.executable, "-m", "tlt.cli", *argv], check=True)
        step = {"name": name, "command": "tlt " + " ".join(argv), "seconds": round(time.time() - t0)}
        # Each finished stage is recorded, so an interrupted build (each stage takes 15-25 minutes)
        # resumes at the stage it was in.
        atomic_write_json(folder / f".stage-{name}.json", {"hash": h, "seconds": step["seconds"], "step": step})
        ran.append(step)

    atomic_write_json(folder / STAMP, {"hash": recipe_hash(r), "recipe": r, "commands": ran,
                                       "seconds": round(time.time() - start)})
    log(f"bench model: built {folder} in {(time.time() - start) / 60:.0f} min")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tlt.bench_model", description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache holds the current recipe")
    args = parser.parse_args(argv)
    try:
        build(force=args.force)
    except subprocess.CalledProcessError as exc:
        print(f"bench model: a build command failed (exit {exc.returncode}); the cache stays incomplete",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
