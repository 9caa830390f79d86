"""Run checkpoints: everything needed to continue a GRPO run exactly, written so none is ever torn.

Layout of a run directory:
    config.json              the resolved TrainConfig
    metrics.jsonl            one JSON object per step (eval rows carry `eval_*` fields)
    checkpoints/latest.json  {"step": k, "dir": "step_00000k"}: the newest complete checkpoint
    checkpoints/step_00000k/
        policy/              a Hugging Face folder (config.json, model.safetensors, tokenizer)
        trainer_state.pt     optimizer, torch and Python RNG states, step, policy version, data position
        drafting.json        {"workers": [...]}: each rollout worker's drafting state, its tuner's and its
                             suffix drafts' calibration (null: it has none); checkpoints of earlier
                             versions hold tuner.json, {"tuners": [...]}, the tuners' alone
        drafter/             the drafter, when it is trained during the run
        drafter_buffer/      the online buffer it trains on (buffer.safetensors, buffer.json), unless
                             drafter.buffer_checkpoint=false
    tensorboard/, wandb/     TensorBoard events and the W&B run, when asked (wandb_run.json holds its id)
    report/                  `tlt report`: figures and report.md
A checkpoint is written into a hidden temporary folder and renamed into place, then `latest.json` is
replaced atomically: a crash at any moment leaves the previous checkpoint as the newest complete one.
Older checkpoints beyond `keep` are removed only after the new one is in place. A save the disk refuses
(an OSError: full, over quota, read-only) raises CheckpointError naming the folder and the OS error,
with the previous checkpoint left as it was. Resume reads the newest checkpoint folder whole before it
restores anything, and falls back to the previous one when a file of it cannot be read (a disk error,
a copy cut short).
"""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from tlt.errors import CheckpointError
from tlt.io import atomic_folder, atomic_write_bytes, atomic_write_json


DRAFTING_FILE = "drafting.json"  # the rollout workers' drafting states
LEGACY_TUNER_FILE = "tuner.json"  # what earlier versions saved instead: the tuners' states alone


@dataclass
class TrainerState:
    """The GRPO trainer's own state (trainer_state.pt): its step (the policy version), the data position,
    the optimizer's state, the torch and Python random states, and the states of the drafter's training
    schedule and of the history store (None where the run has none)."""

    step: int
    data_position: int | None
    optimizer: dict
    torch_rng: torch.Tensor
    python_rng: tuple
    drafter_schedule: dict | None = None
    history: dict | None = None

    def as_dict(self) -> dict:
        """The file's layout, which `load_state` reads back."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def save_checkpoint(run_dir: Path, step: int, policy, tokenizer, state: TrainerState,
                    drafting: list[dict | None] | None = None, drafter=None, keep: int = 2,
                    online_buffer=None) -> Path:
    """Checkpoint `step` of the run in `run_dir` (the layout of the module docstring): the policy and its
    tokenizer, the trainer's `state`, the rollout workers' `drafting` states, the drafter trainer's state
    (`drafter`, a spot.checkpoint.StateSnapshot) and the online buffer; the `keep` newest stay."""
    root = run_dir / "checkpoints"
    final = checkpoint_dir(run_dir, step)
    try:
        with atomic_folder(final) as tmp:
            policy.save_pretrained(tmp / "policy")
            tokenizer.save_pretrained(tmp / "policy")
            buffer = io.BytesIO()
            torch.save(state.as_dict(), buffer)
            atomic_write_bytes(tmp / "trainer_state.pt", buffer.getvalue())
            if drafting is not None:
                atomic_write_json(tmp / DRAFTING_FILE, {"workers": drafting})
            if drafter is not None:
                drafter.save(tmp / "drafter")
            if online_buffer is not None:
                online_buffer.save(tmp / "drafter_buffer")
        atomic_write_json(root / "latest.json", {"step": step, "dir": final.name})
    except CheckpointError:
        raise
    except OSError as exc:  # a full disk, a quota, a read-only or failing file system
        raise CheckpointError(_unsaved(run_dir, final, step, exc)) from None
    steps = sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(checkpoint_dir(run_dir, old), ignore_errors=True)
    return final


def _unsaved(run_dir: Path, final: Path, step: int, exc: OSError) -> str:
    """The one-line error for a checkpoint the disk refused: the folder, the OS error, what is kept."""
    kept = [p.name for p in checkpoints_newest_first(run_dir) if p != final]
    previous = f"the previous checkpoint, {kept[0]}, is kept" if kept else "the run has no earlier checkpoint"
    return (f"{final}: cannot save the checkpoint of step {step} ({exc}); {previous}; free space (or fix the disk) "
            f"and continue with tlt train --resume {run_dir}")


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None when it has none."""
    pointer = run_dir / "checkpoints" / "latest.json"
    if not pointer.exists():
        return None
    try:
        entry = json.loads(pointer.read_text())
        folder = run_dir / "checkpoints" / entry["dir"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{pointer}: unreadable checkpoint pointer ({exc})") from None
    if not (folder / "trainer_state.pt").exists():
        raise CheckpointError(f"{pointer} names {folder}, which has no trainer_state.pt")
    return folder


def load_state(folder: Path) -> TrainerState:
    path = folder / "trainer_state.pt"
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for a corrupt file
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    missing = [k for k in ("step", "optimizer", "torch_rng", "python_rng") if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: no {missing[0]!r} in the trainer state")
    return TrainerState(int(state["step"]), state.get("data_position"), state["optimizer"], state["torch_rng"],
                        state["python_rng"], state.get("drafter_schedule"), state.get("history"))


def checkpoints_newest_first(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders, highest step first. Each was renamed into place complete, so a
    folder newer than latest.json (a kill between the rename and the pointer's update) is a good one."""
    found = [(int(p.name[5:]), p) for p in (run_dir / "checkpoints").glob("step_*")
             if p.is_dir() and p.name[5:].isdigit()]
    return [p for _, p in sorted(found, reverse=True)]


@dataclass
class SavedCheckpoint:
    """A run checkpoint read into memory and checked: the trainer state, the policy's tensors, the
    workers' drafting states (and the file they came from) and the drafter trainer's state (None where the
    run had none). The online buffer, which may be large, is read when it is restored (OnlineBuffer.load
    checks it before it replaces anything)."""

    folder: Path
    state: TrainerState
    policy: dict[str, torch.Tensor]
    drafting: list[dict | None] | None
    drafter: dict | None
    buffer: Path | None
    drafting_file: Path | None = None


def read_checkpoint(folder: Path) -> SavedCheckpoint:
    """Every file of checkpoint `folder`, read and checked; CheckpointError names the first bad one."""
    from tlt.model.checkpoint import read_tensors
    from tlt.spot.checkpoint import read_state

    state = load_state(folder)
    policy = read_tensors(folder / "policy")
    drafting_file = next((folder / name for name in (DRAFTING_FILE, LEGACY_TUNER_FILE) if (folder / name).exists()), None)
    drafting = read_drafting(drafting_file) if drafting_file is not None else None
    drafter = read_state(folder / "drafter") if (folder / "drafter").is_dir() else None
    buffer = folder / "drafter_buffer" if (folder / "drafter_buffer").is_dir() else None
    return SavedCheckpoint(folder, state, policy, drafting, drafter, buffer, drafting_file)


def read_drafting(path: Path) -> list[dict | None]:
    """The workers' drafting states of a drafting.json ({"workers": [...]}), or their tuner states of an
    earlier version's tuner.json ({"tuners": [...]}, or one tuner's state alone)."""
    from tlt.model.checkpoint import read_json

    saved = read_json(path)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: not a drafting state (a JSON object expected)")
    key = "workers" if path.name == DRAFTING_FILE else "tuners"
    states = saved.get(key, None if key == "workers" else [saved])
    if not isinstance(states, list) or not all(s is None or isinstance(s, dict) for s in states):
        raise CheckpointError(f"{path}: not a drafting state ({key!r} is not a list of objects and nulls)")
    return states


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Remove the hidden folders of checkpoints a kill interrupted before their rename."""
    for tmp in (run_dir / "checkpoints").glob(".tmp-step_*"):
        shutil.rmtree(tmp, ignore_errors=True)
