"""Run checkpoints: everything needed to continue a GRPO run exactly, written so none is ever torn.

Layout of a run directory:
    config.json              the resolved TrainConfig
    metrics.jsonl            one JSON object per step (eval rows carry `eval_*` fields)
    checkpoints/latest.json  {"step": k, "dir": "step_00000k"}: the newest complete checkpoint
    checkpoints/step_00000k/
        policy/              a Hugging Face folder (config.json, model.safetensors, tokenizer)
        trainer_state.pt     optimizer, torch and Python RNG states, step, policy version, data position
        tuner.json           the adaptive engine's tuner, when there is one
        drafter/             the drafter, when it is trained during the run
        drafter_buffer/      the online buffer it trains on (buffer.safetensors, buffer.json), unless
                             drafter_buffer_checkpoint=false
    tensorboard/, wandb/     TensorBoard events and the W&B run, when asked (wandb_run.json holds its id)
    report/                  `tlt report`: figures and report.md
A checkpoint is written into a hidden temporary folder and renamed into place, then `latest.json` is
replaced atomically: a crash at any moment leaves the previous checkpoint as the newest complete one.
Older checkpoints beyond `keep` are removed only after the new one is in place.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import torch

from tlt.errors import CheckpointError
from tlt.io import atomic_folder, atomic_write_bytes, atomic_write_json


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def save_checkpoint(run_dir: Path, step: int, policy, tokenizer, state: dict, tuner_state: dict | None = None,
                    drafter=None, keep: int = 2, online_buffer=None) -> Path:
    root = run_dir / "checkpoints"
    final = checkpoint_dir(run_dir, step)
    with atomic_folder(final) as tmp:
        policy.save_pretrained(tmp / "policy")
        tokenizer.save_pretrained(tmp / "policy")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        atomic_write_bytes(tmp / "trainer_state.pt", buffer.getvalue())
        if tuner_state is not None:
            atomic_write_json(tmp / "tuner.json", tuner_state)
        if drafter is not None:
            drafter.save(tmp / "drafter")
        if online_buffer is not None:
            online_buffer.save(tmp / "drafter_buffer")
    atomic_write_json(root / "latest.json", {"step": step, "dir": final.name})
    steps = sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(checkpoint_dir(run_dir, old), ignore_errors=True)
    return final


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


def load_state(folder: Path) -> dict:
    try:
        return torch.load(folder / "trainer_state.pt", map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for a corrupt file
        raise CheckpointError(f"{folder / 'trainer_state.pt'}: cannot be read ({exc})") from None
