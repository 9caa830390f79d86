"""Drafter trainer checkpoints: the spot trainer's state on disk, written in the background.

`DrafterCheckpointer`: a snapshot of the state is taken at once (a copy of a few MB) and
written by a background thread into a hidden temporary folder, which is renamed into place before
`latest.json` is replaced; a kill at any moment leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tlt.errors import CheckpointError

if TYPE_CHECKING:
    from tlt.spot.trainer import SpotTrainer


class DrafterCheckpointer:
    """Asynchronous, atomic checkpoints of the spot trainer's state under `root`:
        root/latest.json           {"version": v, "dir": "drafter_00000v"}
        root/drafter_00000v/       drafter.safetensors + drafter_config.json (a loadable drafter folder),
                                   optimizer.pt, spot.json (counters and schedule)
    The one just written stays, with the `keep` - 1 highest-numbered others."""

    def __init__(self, root: str | os.PathLike, keep: int = 2) -> None:
        self.root, self.keep = Path(root), keep
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.written: list[Path] = []

    def save_async(self, state: dict, drafter_config, extra: dict | None = None) -> None:
        """Snapshot a `SpotTrainer.state_dict()` now, write it in the background (after any write still
        in flight)."""
        self.wait()
        snapshot = _snapshot(state)
        self._thread = threading.Thread(target=self._write, args=(snapshot, drafter_config, extra or {}),
                                        name="drafter-checkpoint", daemon=True)
        self._thread.start()

    def save(self, state: dict, drafter_config, extra: dict | None = None) -> Path:
        self.save_async(state, drafter_config, extra)
        self.wait()
        return self.written[-1]

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"{self.root}: drafter checkpoint failed ({error})") from error

    def _write(self, snapshot: dict, drafter_config, extra: dict) -> None:
        try:
            self.written.append(write_checkpoint(self.root, snapshot, drafter_config, extra, self.keep))
        except BaseException as exc:  # reported by the next wait()
            self.error = exc


def _snapshot(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state["optimizer"], buffer)  # serialised now: later optimizer steps cannot leak in
    return {"drafter": {k: v.detach().to("cpu", copy=True) for k, v in state["drafter"].items()},
            "optimizer": buffer.getvalue(),
            "steps": state["steps"], "version": state["version"]}


def write_checkpoint(root: Path, snapshot: dict, drafter_config, extra: dict, keep: int = 2) -> Path:
    from tlt.io import atomic_folder, atomic_write_json

    final = root / f"drafter_{snapshot['version']:08d}"
    with atomic_folder(final) as tmp:
        write_files(tmp, snapshot, drafter_config, extra)
    atomic_write_json(root / "latest.json", {"version": snapshot["version"], "dir": final.name})
    # The one just written stays whatever its number: a new run writing into an old run's folder
    # starts again at low versions, and latest.json now names this one.
    others = sorted(p for p in root.glob("drafter_*") if p.is_dir() and p != final)
    for old in others[: max(len(others) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class StateSnapshot:
    """A trainer state with a `save(folder)` that writes the checkpoint files into `folder` (for the run
    checkpoint, which is itself written atomically as a whole)."""

    def __init__(self, state: dict, drafter_config, extra: dict | None = None) -> None:
        self.snapshot, self.drafter_config, self.extra = _snapshot(state), drafter_config, extra or {}

    def save(self, folder: str | os.PathLike) -> None:
        write_files(Path(folder), self.snapshot, self.drafter_config, self.extra)


def write_files(folder: Path, snapshot: dict, drafter_config, extra: dict) -> None:
    from dataclasses import asdict

    from safetensors.torch import save

    from tlt.io import atomic_write_bytes, atomic_write_json

    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / "drafter.safetensors", save(snapshot["drafter"], metadata={"format": "pt"}))
    atomic_write_json(folder / "drafter_config.json", asdict(drafter_config))
    atomic_write_bytes(folder / "optimizer.pt", snapshot["optimizer"])
    atomic_write_json(folder / "spot.json", {"steps": snapshot["steps"], "version": snapshot["version"], **extra})


def read_state(folder: str | os.PathLike) -> dict:
    """A `SpotTrainer.state_dict()` from a checkpoint folder (drafter weights, optimizer, counters)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in ("drafter.safetensors", "optimizer.pt", "spot.json"):
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder}: drafter checkpoint has no {name}")
    try:
        meta = json.loads((folder / "spot.json").read_text())
        optimizer = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False)
        weights = load_file(str(folder / "drafter.safetensors"))
    except Exception as exc:  # json, torch and safetensors raise several types for a corrupt file
        raise CheckpointError(f"{folder}: drafter checkpoint cannot be read ({exc})") from None
    return {"drafter": weights, "optimizer": optimizer, "steps": int(meta["steps"]), "version": int(meta["version"])}


def latest_drafter_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete drafter checkpoint under `root`, or None."""
    pointer = Path(root) / "latest.json"
    if not pointer.exists():
        return None
    try:
        folder = Path(root) / json.loads(pointer.read_text())["dir"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{pointer}: unreadable checkpoint pointer ({exc})") from None
    for name in ("drafter.safetensors", "drafter_config.json", "optimizer.pt", "spot.json"):
        if not (folder / name).is_file():
            raise CheckpointError(f"{pointer} names {folder}, which has no {name}")
    return folder


def load_checkpoint(folder: Path, trainer: SpotTrainer) -> dict:
    """Restore `trainer` from a checkpoint folder; returns its spot.json."""
    from tlt.speculative.drafter import check_tensors

    state = read_state(folder)
    check_tensors(state["drafter"], trainer.drafter.state_dict(), str(Path(folder) / "drafter.safetensors"))
    trainer.load_state_dict(state)
    return json.loads((Path(folder) / "spot.json").read_text())
