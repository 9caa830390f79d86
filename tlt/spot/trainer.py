"""The spot trainer: drafter training in the idle time of rollout workers, stopped the moment rollout ends.

`SpotTrainer.train(batches, should_stop)` takes optimizer steps on the EAGLE loss (speculative/train.py)
until `should_stop()` turns true. It is checked before every step and inside the step in flight:
between training-time-test rounds and as each trainable parameter's gradient arrives in the backward
pass. A step stopped inside is dropped (gradients cleared, no update), so the weights are always those
of a whole number of steps, and a stop is honoured within one round's forward or one parameter's share
of the backward however long a step is (a step of several rounds beside a busy rollout worker is long,
and a phase that ran on would overlap the policy update). `max_steps` caps a phase on top. The state that moves between workers (`state_dict`) is the
drafter's trainable weights, the optimizer state and the counters: the target's embedding and head are
never part of it.

When to train (`Schedule`, by `train`): "every" RL step, "every-N" (`train_every` steps apart), or
"acceptance" (the default), which trains while the drafter is behind or still learning: when no
acceptance length has been measured yet, when the current level fell below `train_fraction` of the
best level seen (the policy moved away from the drafter), or when it beat the previous best by more
than 2% (the last phase helped, so the drafter has not converged: a cold-started drafter keeps
training until it plateaus). A converged drafter under a slowly moving policy trains only when its
acceptance drops. The level is the median of the last 3 rollouts' acceptance lengths, and the best
level fades by 1% per rollout unless renewed: one rollout's figure swings with which arms the tuner ran
and on which samples, and single rollouts judged against the all-time best (an extreme of that noise,
creeping upward) would look like a drop at most steps of a converged run and train at all of them. The
first phase waits until the buffer holds `min_pairs` pairs.

Checkpoints (`DrafterCheckpointer`): a snapshot of the state is taken at once (a copy of a few MB) and
written by a background thread into a hidden temporary folder, which is renamed into place before
`latest.json` is replaced; a kill at any moment leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tlt.errors import CheckpointError
from tlt.model.rope import RopeTables
from tlt.model.transformer import OnLMHead
from tlt.speculative.data import PackedBatch
from tlt.spot.config import SpotConfig


IMPROVEMENT = 0.02  # a new best by more than this fraction means the drafter is still learning
LEVEL_OF = 3  # rollouts whose median acceptance is the level the schedule judges
BEST_FADE = 0.99  # the best level, unless renewed, shrinks by this factor per observed rollout


class Schedule:
    """Decides, per RL step, whether released workers train the drafter (see the module docstring)."""

    def __init__(self, config: SpotConfig) -> None:
        self.config = config
        self.best: float | None = None  # the best level seen
        self.recent: list[float] = []  # the last LEVEL_OF measurements
        self.improving = True

    @property
    def last(self) -> float | None:
        """The current level: the median of the recent measurements (None before any)."""
        return statistics.median(self.recent) if self.recent else None

    def observe(self, acceptance: float | None) -> None:
        """The acceptance length of the rollout that just ended (None: no drafter step ran)."""
        if acceptance is not None and math.isfinite(acceptance):
            self.recent = (self.recent + [float(acceptance)])[-LEVEL_OF:]
            level = self.last
            self.improving = self.best is None or level > self.best * (1 + IMPROVEMENT)
            self.best = level if self.best is None else max(self.best * BEST_FADE, level)

    def due(self, step: int, buffered_pairs: int) -> bool:
        c = self.config
        if c.train == "off" or buffered_pairs < c.min_pairs:
            return False
        if c.train == "every":
            return True
        if c.train == "every-N":
            return step % c.train_every == 0
        return self.last is None or self.improving or self.last < c.train_fraction * self.best

    def state_dict(self) -> dict:
        return {"best": self.best, "recent": list(self.recent), "improving": self.improving}

    def load_state_dict(self, state: dict) -> None:
        """A state with a single "last" measurement and no "recent" list starts `recent` with it."""
        self.best, self.improving = state.get("best"), state.get("improving", True)
        old = [] if state.get("last") is None else [state["last"]]
        self.recent = [float(a) for a in state.get("recent", old)]


@dataclass
class PhaseReport:
    """What one spot phase did: its optimizer steps and seconds, why it stopped, the mean of each loss
    term (speculative.train.unrolled_loss) over its steps; on a pool also the worker it ran on, the
    drafter offers it made to the tail, and whether it was lost with its worker."""

    steps: int = 0
    seconds: float = 0.0
    stop_latency_s: float | None = None  # from the stop request to the loop's exit
    stopped: str = "stop"  # stop, max_steps
    losses: dict[str, float] = field(default_factory=dict)
    worker: int | None = None
    offers: int = 0
    lost: bool = False


class Preempted(Exception):
    """A stop requested inside an optimizer step: the step is dropped, not applied."""


class SpotTrainer:
    def __init__(self, drafter, config: SpotConfig) -> None:
        self.drafter, self.config = drafter, config
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                           betas=(0.9, 0.95))
        self.steps = 0  # optimizer steps over the run
        self.version = 0  # drafter versions published (one per phase that stepped)

    def train(self, batches: Iterator[PackedBatch], should_stop: Callable[[], bool],
              stop_requested_at: Callable[[], float | None] | None = None,
              after_step: Callable[[int], None] | None = None) -> PhaseReport:
        """Optimizer steps until `should_stop()` (checked before each) or `max_steps`. `stop_requested_at`
        returns the perf_counter time of the stop request, to measure the preemption latency;
        `after_step(steps taken in this phase)` runs after each optimizer step."""
        from tlt.speculative.train import unrolled_loss

        c, loss_config = self.config, self.config.loss_config()
        device = self.drafter.target.device

        def interrupt() -> None:
            if should_stop():
                raise Preempted

        def on_grad(grad: torch.Tensor) -> torch.Tensor:
            interrupt()
            return grad

        hooks = [p.register_hook(on_grad) for p in self.drafter.parameters() if p.requires_grad]
        self.drafter.train()
        result, sums = PhaseReport(), {}
        start = time.perf_counter()
        try:
            while True:
                if should_stop():
                    result.stopped = "stop"
                    break
                if c.max_steps and result.steps >= c.max_steps:
                    result.stopped = "max_steps"
                    break
                batch = next(batches).to(device, self.drafter.fc.weight.dtype)
                for group in self.optimizer.param_groups:
                    group["lr"] = self.learning_rate()
                self.optimizer.zero_grad(set_to_none=True)
                try:
                    loss, m = unrolled_loss(self.drafter, batch, loss_config, interrupt)
                    loss.backward()
                except Preempted:
                    self.optimizer.zero_grad(set_to_none=True)
                    result.stopped = "stop"
                    break
                torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), c.grad_clip)
                self.optimizer.step()
                result.steps += 1
                self.steps += 1
                if after_step is not None:
                    after_step(result.steps)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
        finally:
            for hook in hooks:
                hook.remove()
            self.drafter.eval()
        end = time.perf_counter()
        result.seconds = end - start
        requested = stop_requested_at() if stop_requested_at is not None else None
        if result.stopped == "stop" and requested is not None:
            result.stop_latency_s = max(end - requested, 0.0)
        result.losses = {k: v / result.steps for k, v in sums.items()} if result.steps else {}
        if result.steps:
            self.version += 1
        return result

    def learning_rate(self) -> float:
        """`lr`, ramped up linearly over the trainer's first `warmup_steps` optimizer steps (over all
        phases): a fresh Adam's first updates are about lr in every weight whatever the gradient, which
        would knock an already trained drafter off its optimum."""
        c = self.config
        return c.lr * min(1.0, (self.steps + 1) / c.warmup_steps) if c.warmup_steps else c.lr

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"drafter": self.drafter.trainable_state(), "optimizer": self.optimizer.state_dict(),
                "steps": self.steps, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict({k: v.to(self.drafter.fc.weight.dtype) for k, v in state["drafter"].items()})
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.version = int(state["steps"]), int(state["version"])


def run_phase(drafter, state: dict | None, records: list, weights: list[float], config: SpotConfig, seed: int,
              should_stop: Callable[[], bool] = lambda: False, stop_requested_at=None,
              after_step=None) -> tuple[dict, PhaseReport]:
    """One spot phase on `drafter` (trained in place) from the trainer state `state` (None: fresh), over
    `records` drawn by `weights`; returns (new trainer state, phase report). Where the phase runs, in
    the driver or on a Ray worker, is the caller's business."""
    from tlt.spot.buffer import Entry, sampled_batches

    # An engine in bf16 / fp16 keeps serving its drafter in that dtype; training runs on a float32 twin,
    # whose weights go back into the engine's drafter (cast) after the phase and before each hook.
    trained = drafter if drafter.fc.weight.dtype == torch.float32 else float32_twin(drafter)

    def publish() -> None:
        if trained is not drafter:
            with torch.no_grad():
                for name, tensor in drafter.state_dict().items():
                    tensor.copy_(trained.state_dict()[name])

    def hook(steps: int) -> None:
        publish()
        after_step(steps)

    trainer = SpotTrainer(trained, config)
    if state is not None:
        trainer.load_state_dict(state)
    entries = [Entry(r, 0, j) for j, r in enumerate(records)]
    batches = sampled_batches(entries, weights, config.rows, config.row_tokens, config.window, seed)
    result = trainer.train(batches, should_stop, stop_requested_at, hook if after_step is not None else None)
    publish()
    return trainer.state_dict(), result


class TargetHead(OnLMHead, torch.nn.Module):
    """The only parts of a target a drafter uses (embedding, LM head, RoPE tables, config), as float32
    copies: what a float32 twin of a bf16 / fp16 engine's drafter trains against."""

    def __init__(self, target) -> None:
        super().__init__()
        c = self.config = target.config
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        self.lm_head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        with torch.no_grad():
            self.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            if c.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
            else:
                self.lm_head.weight.copy_(target.lm_head.weight)
        self.register_buffer("inv_freq", target.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scaling_factor = target.rope_scaling_factor
        self.rope = RopeTables()
        self.requires_grad_(False)
        self.to(target.device)


def float32_twin(drafter):
    """A float32 copy of `drafter` (trainable weights) over a float32 `TargetHead` of its target."""
    from tlt.speculative.drafter import Drafter

    twin = Drafter(TargetHead(drafter.target), drafter.config)
    twin.load_state_dict({k: v.float() for k, v in drafter.state_dict().items()})
    return twin


# --- checkpoints -----------------------------------------------------------------------------------
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
