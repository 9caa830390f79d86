"""Rollout workers: engine replicas that generate a share of each rollout and train the drafter when idle.

`RolloutWorker` is a plain class holding one `RolloutEngine` (its own model copy, threads or device);
`RayPool` runs W of them as Ray actors and is a drop-in for the engine's `generate`: same prompts and
`SamplingParams` in, the same `RequestOutput`s out, in order. Outputs depend only on each request's
seed (counter-based sampling), so where a group runs changes nothing it returns.

One rollout on the pool:
  1. shares: whole groups (a prompt's n samples share one prefill) are spread over the workers by
     predicted cost (shares.py);
  2. every worker generates its share; results arrive as workers finish;
  3. a finished worker is released (coordinator.py). The responses' target features go into the online
     buffer; if drafter training is due and others still generate, the released worker becomes the
     spot trainer and trains the drafter on the buffer (the trainer state travels to it and back);
  4. when the last share is in, the trainer is told to stop (it does within part of one optimizer
     step); its state is collected before the next rollout, whose workers all start from the newest drafter.
Faults: a worker that dies mid-rollout (its actor is gone) is replaced by a fresh one, brought to the
current policy, drafter and drafting state, and its share is generated again. A share's results are
taken once, whole, from the worker that completed it, so no sample is lost or duplicated, and the
re-run returns exactly what the dead worker would have (same seeds). A spot trainer that dies only
loses its phase: the drafter stays at the last collected state.

Ray runs a local cluster by default (one worker per core, dashboard off, loopback only; cluster.py) or joins
`address`; the same code runs on a multi-node cluster, each worker asking Ray for `cpus` CPUs and
`gpus` GPUs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from tlt.errors import ConfigError
from tlt.rollout.config import EngineConfig
from tlt.rollout.stats import RolloutStats
from tlt.spot.cluster import start_ray

if TYPE_CHECKING:
    from tlt.spot.trainer import PhaseReport


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds: `model` (folder or built-in name), `engine` (its config, without a progress
    bar; its drafter a folder, "default", "random": a fresh one seeded by `seed`, or None), torch
    `threads`, `device` ("cpu", "cuda" or None: cuda when the worker sees one), the weights' `dtype`
    (None: float32)."""

    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    threads: int = 1
    device: str | None = None
    dtype: str | None = None
    seed: int = 0


@dataclass
class ShareStats:
    """What a worker measured generating its share of a rollout: its engine's stats and the drafters
    it swapped in mid-rollout."""

    rollout: RolloutStats
    drafter_swaps: int = 0

    @classmethod
    def merge(cls, parts: Sequence["ShareStats"]) -> "ShareStats":
        """One record for a rollout spread over workers: RolloutStats.merge (counts add, per-step lists
        concatenate worker after worker, wall time is the slowest worker's), the swaps summed."""
        return cls(RolloutStats.merge([p.rollout for p in parts]), sum(p.drafter_swaps for p in parts))


class RolloutWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        from tlt.model import load_model
        from tlt.rollout import RolloutEngine

        self.spec = spec
        if spec.threads:
            torch.set_num_threads(spec.threads)
        device = spec.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(spec.model, dtype=spec.dtype, device=device)
        drafter = spec.engine.drafter
        if drafter == "random":
            from tlt.speculative.drafter import Drafter

            drafter = Drafter.from_target(model, seed=spec.seed).eval()
        self.engine = RolloutEngine(model, None, replace(spec.engine, drafter=drafter, progress=False))
        # Phases are numbered by the driver, and a stop names its phase: a stop that overtakes its
        # phase's start (the phase still unpacking its records) still stops it, and cannot stop a later one.
        self._stopped_phase = -1
        self._stop_at: dict[int, float] = {}
        self._lock = threading.Lock()
        self._offer: tuple[dict, int] | None = None  # a drafter to swap in at the next engine step
        self._swaps = 0  # drafters swapped in during the current rollout

    def ping(self) -> int:
        return os.getpid()

    def load_weights(self, state: dict, version: int) -> None:
        self.engine.load_weights(state, version)

    def load_drafter(self, state: dict, version: int) -> None:
        self.engine.load_drafter(state, version)

    def drafter_tensor(self, name: str) -> torch.Tensor:
        return self.engine.drafter.state_dict()[name].detach().clone().cpu()

    def drafting_state(self) -> dict | None:
        return self.engine.drafting_state()

    def load_drafting_state(self, state: dict | None) -> None:
        self.engine.load_drafting_state(state)

    def generate(self, prompts: list[list[int]], params: list, weights_version: int,
                 history=None) -> tuple[list, ShareStats]:
        """(RequestOutputs, what the share measured) of one share, drafting from `history` (HistoryDrafts
        of the share) too; hidden states come back as ordinary tensors.
        Between engine steps a drafter offered by the spot trainer (`offer_drafter`) is swapped in."""
        self._swaps = 0
        self.engine.step_callback = self._between_steps
        try:
            self.engine.reset_stats()
            outputs = self.engine.generate(prompts, params, weights_version=weights_version, history=history)
        finally:
            self.engine.step_callback = None
            self._offer = None  # an offer that came too late is superseded by the next rollout's drafter
        for out in outputs:
            for c in out.outputs:
                if c.hidden_states is not None:
                    c.hidden_states = c.hidden_states.clone().cpu()  # out of inference mode, off the device
                if c.layer_states is not None:
                    c.layer_states = c.layer_states.clone().cpu()
        return outputs, ShareStats(self.engine.rollout_stats, self._swaps)

    def _between_steps(self, engine) -> None:
        offer, self._offer = self._offer, None
        if offer is not None:
            engine.load_drafter(*offer)
            self._swaps += 1

    def offer_drafter(self, state: dict, version: int) -> None:
        """A newer drafter from the spot trainer, taken between two engine steps of the running rollout
        (lossless whenever it lands: verification does not depend on the drafter)."""
        self._offer = (state, version)

    # --- spot training -------------------------------------------------------------------------------
    def train(self, phase: int, state: dict | None, records: list, weights: list[float], config,
              seed: int, peers: Sequence = (), swap_every: int = 0) -> tuple[dict, PhaseReport]:
        """Train the engine's drafter on `records` until `stop_training(phase)` (or the config's
        max_steps); returns (trainer state, phase report). The engine's drafter keeps the trained weights.
        With `swap_every` > 0 the drafter is offered to `peers` (the workers still in the tail, as Ray
        actor handles) every that many optimizer steps."""
        from tlt.spot.trainer import run_phase

        drafter = self.engine.drafter
        if drafter is None:
            raise ConfigError("spot training needs a learned drafter in the engine")
        version = state["version"] + 1 if state is not None else 1  # the version this phase will publish
        offered = 0

        def after_step(steps: int) -> None:
            nonlocal offered
            if swap_every and peers and steps % swap_every == 0:
                import ray

                ref = ray.put(drafter.trainable_state())
                for peer in peers:
                    peer.offer_drafter.options(concurrency_group="control").remote(ref, version)
                offered += 1

        state, report = run_phase(drafter, state, records, weights, config, seed,
                                  lambda: self._stopped_phase >= phase, lambda: self._stop_at.get(phase),
                                  after_step if swap_every and peers else None)
        return state, replace(report, offers=offered)

    def stop_training(self, phase: int) -> None:
        with self._lock:
            self._stop_at.setdefault(phase, time.perf_counter())
            self._stopped_phase = max(self._stopped_phase, phase)


# --- the Ray pool ----------------------------------------------------------------------------------
class RayPool:
    worker = RolloutWorker  # the class each actor runs

    def __init__(self, specs: Sequence[WorkerSpec], address: str | None = None, cpus_per_worker: float = 1,
                 gpus_per_worker: float = 0, log: Callable[[str], None] = print) -> None:
        import ray

        start_ray(address, cpus=max(len(specs), os.cpu_count() or 1) if address is None else None, log=log)
        self.ray, self.log = ray, log
        self.specs = list(specs)
        self._actor_class = ray.remote(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=0,
                                       concurrency_groups={"control": 1})(self.worker)
        self.actors = [self._spawn(s) for s in self.specs]
        ray.get([a.ping.remote() for a in self.actors])
        self.policy: tuple[object, int] | None = None  # (object ref of the state, version)
        self.drafter: tuple[object, int] | None = None
        self.drafting: list[dict | None] = [None] * len(self.specs)  # each worker's drafting state, last collected
        self.restarts = 0

    def __len__(self) -> int:
        return len(self.actors)

    def _spawn(self, spec: WorkerSpec):
        return self._actor_class.remote(spec)

    def restart(self, w: int):
        """Replace worker w with a fresh actor at the current policy, drafter and drafting state."""
        actor = self._spawn(self.specs[w])
        calls = []
        if self.policy is not None:
            calls.append(actor.load_weights.remote(*self.policy))
        if self.drafter is not None:
            calls.append(actor.load_drafter.remote(*self.drafter))
        calls.append(actor.load_drafting_state.remote(self.drafting[w]))
        self.ray.get(calls)
        self.actors[w] = actor
        self.restarts += 1
        return actor

    def load_weights(self, state: dict, version: int) -> None:
        # Sent in the workers' dtype: the cast each worker's copy would make (round to nearest even),
        # made once here, so bf16 workers map half the bytes and the object store holds half.
        dtype = self._weights_dtype()
        ref = self.ray.put({k: (v.detach().to(dtype) if v.is_floating_point() and dtype else v.detach()).cpu()
                            for k, v in state.items()})
        self.policy = (ref, version)
        self.ray.get([a.load_weights.remote(ref, version) for a in self.actors])

    def _weights_dtype(self) -> torch.dtype | None:
        """The workers' weight dtype when they share one given by name, else None (send as it is)."""
        from tlt.model.checkpoint import DTYPES

        names = {s.dtype or "float32" for s in self.specs}
        return DTYPES.get(names.pop()) if len(names) == 1 else None

    def load_drafter(self, state: dict, version: int) -> None:
        ref = self.ray.put(state)
        self.drafter = (ref, version)
        self.ray.get([a.load_drafter.remote(ref, version) for a in self.actors])

    def collect_drafting(self) -> list[dict | None]:
        self.drafting = self.ray.get([a.drafting_state.remote() for a in self.actors])
        return self.drafting

    def load_drafting(self, states: Sequence[dict | None]) -> None:
        if len(states) != len(self.actors):
            raise ConfigError(f"drafting states for {len(states)} workers, the pool has {len(self.actors)}")
        self.drafting = list(states)
        self.ray.get([a.load_drafting_state.remote(s) for a, s in zip(self.actors, states)])

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
