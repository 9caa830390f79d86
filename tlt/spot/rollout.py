"""Rollout with an adaptive drafter: the GRPO trainer's single entry point for generating a step.

`RolloutBackend` is everything the trainer calls on the rollout side; `make_rollout` builds one from
the run's config (the drafter resolved, the online drafter training set up, workers counted):
  - `LocalRollout`: the in-process engine (one worker). With no second worker there is no idle time
    to train in, so a due drafter phase runs after the rollout for `local_steps` optimizer steps and is
    counted in the step's drafter time: the honest cost of training on the critical path.
  - `PooledRollout`: W Ray workers (workers.py). Released workers train the drafter in the tail; the
    phase is stopped when the last share is in, and its state is collected at the end of the RL step
    (long finished by then: the reward and the policy update run in between).
Both keep the `DrafterLearning` state on the driver: the online buffer, the schedule, the newest
trainer state (drafter weights, optimizer, counters) and its asynchronous checkpoints. At the start
of every rollout, every worker holds the newest drafter.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tlt.errors import ConfigError
from tlt.rollout.stats import RolloutStats
from tlt.speculative.strategy import Strategy
from tlt.spot.buffer import OnlineBuffer, favour_long, keep_recent
from tlt.spot.coordinator import Coordinator, WorkerTimes
from tlt.spot.config import SpotConfig
from tlt.spot.checkpoint import DrafterCheckpointer
from tlt.spot.schedule import Schedule
from tlt.spot.trainer import PhaseReport, run_phase
from tlt.spot.shares import LengthPredictor, assign
from tlt.spot.workers import ShareStats

if TYPE_CHECKING:
    from tlt.rl.config import TrainConfig

STOP_TIMEOUT_S = 120.0  # a stopped spot trainer returns within part of one optimizer step; this only catches a hang


@dataclass
class PoolReport:
    """The workers' side of a rollout on a pool: their time split (Coordinator), the prompts of each
    share, the drafter version every worker started from, the drafters swapped in mid-rollout, and
    whether drafter training was due (None: the drafter does not learn)."""

    times: WorkerTimes
    shares: list[int]
    drafter_version: int
    drafter_swaps: int
    training_due: bool | None = None

    def as_dict(self) -> dict:
        """The metrics' "workers" entry: the time split's fields and this record's, flat."""
        out = {**asdict(self.times), **{k: v for k, v in asdict(self).items() if k != "times"}}
        if self.training_due is None:
            del out["training_due"]
        return out


@dataclass
class RolloutReport:
    """What one rollout measured: the engines' stats (merged over a pool's workers) and, on a pool, the
    workers' side."""

    stats: RolloutStats
    pool: PoolReport | None = None


def drafter_acceptance(stats: RolloutStats) -> float | None:
    """Tokens per row per step over the steps whose strategy used the learned drafter (chain, tree)."""
    return stats.acceptance_length(drafts_with_learned)


def drafter_arms(stats: RolloutStats) -> dict[str, tuple[float, int]]:
    """Per strategy that used the learned drafter: (tokens per row per step, row-steps), what the
    training schedule judges the drafter by (tlt/spot/schedule.py)."""
    rows = stats.rows_by_strategy()
    return {s: (a, rows[s]) for s, a in stats.acceptance_by_strategy().items() if drafts_with_learned(s)}


@functools.cache
def drafts_with_learned(strategy: str) -> bool:
    """Whether the strategy named `strategy` drafts with the learned drafter; each name is parsed once
    per process, not at every RL step."""
    return Strategy.parse(strategy).uses_drafter


class DrafterLearning:
    """Driver-side state of online drafter training (see the module docstring)."""

    def __init__(self, config: SpotConfig, drafter_config, checkpoint_root: str | Path | None = None,
                 log: Callable[[str], None] = print, evict=None, sample=None, seed: int = 0) -> None:
        self.config, self.drafter_config, self.log, self.seed = config, drafter_config, log, seed
        self.buffer = OnlineBuffer(config.buffer_mb << 20, evict or keep_recent(config.buffer_steps),
                                   sample or favour_long(1.0))
        self.schedule = Schedule(config)
        self.state: dict | None = None  # SpotTrainer.state_dict() of the newest phase
        self.checkpointer = DrafterCheckpointer(checkpoint_root) if checkpoint_root is not None else None

    @property
    def version(self) -> int:
        return 0 if self.state is None else int(self.state["version"])

    def due(self, step: int) -> bool:
        return self.schedule.due(step, self.buffer.pairs)

    def add(self, outputs, version: int) -> None:
        import torch

        from tlt.speculative.data import DraftRecord

        layer_ids = tuple(self.drafter_config.feature_layers or ())
        records = []
        for out in outputs:
            for c in out.outputs:
                if c.hidden_states is None:
                    raise ConfigError("drafter training needs the rollout's hidden states (return_hidden_states)")
                if layer_ids and c.layer_states is None:
                    raise ConfigError(f"the drafter reads target layers {layer_ids} but the rollout returned none; "
                                      "the engines must run the same drafter")
                records.append(DraftRecord(torch.tensor(c.token_ids), c.hidden_states, len(out.prompt_token_ids),
                                           c.layer_states if layer_ids else None, layer_ids))
        self.buffer.add(records, version)

    def payload(self) -> tuple[list, list[float]]:
        entries = self.buffer.entries
        return [e.record for e in entries], self.buffer.sample(entries)

    def accept(self, state: dict, report: PhaseReport, step: int) -> None:
        """Take a finished phase's trainer state (when it published weights) and checkpoint it in the
        background."""
        if report.kept == 0:
            return
        self.state = state
        if self.checkpointer is not None:
            self.checkpointer.save_async(state, self.drafter_config, {"rl_step": step})

    def metrics(self, phase: PhaseReport | None) -> dict:
        """The step's drafter figures: version, the spot phase (optimizer steps, the steps whose weights
        it published, held-out scores at its start and of what it published, seconds, preemption latency,
        loss; None: no phase ran) and the buffer's size."""
        phase = phase or PhaseReport()
        return {"drafter_version": self.version, "drafter_phase_steps": phase.steps,
                "drafter_phase_kept": phase.kept, "drafter_heldout_start": phase.heldout_start,
                "drafter_heldout_kept": phase.heldout_kept,
                "drafter_phase_s": phase.seconds, "drafter_stop_latency_s": phase.stop_latency_s,
                "drafter_top1": phase.losses.get("top1"), "drafter_buffer_pairs": self.buffer.pairs,
                "drafter_buffer_bytes": self.buffer.nbytes}

    def snapshot(self, step: int):
        """The newest trainer state as something a run checkpoint can save (None: no phase published one yet)."""
        from tlt.spot.checkpoint import StateSnapshot

        return StateSnapshot(self.state, self.drafter_config, {"rl_step": step}) if self.state is not None else None

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()


class RolloutBackend(Protocol):
    """What the GRPO trainer calls on the rollout side, in-process (`LocalRollout`) or on a Ray pool
    (`PooledRollout`). `engine` is the in-process engine (None on a pool); `learning` the online
    drafter training (None when the drafter does not learn)."""

    workers: int
    engine: object | None
    learning: DrafterLearning | None

    def load_weights(self, state: dict, version: int) -> None:
        """Every engine takes the policy weights `state` as version `version`."""
        ...

    def generate(self, prompts, params, weights_version: int, step: int, learn: bool = True,
                 history=None) -> tuple[list, RolloutReport]:
        """The outputs of `prompts` (in order) and what the rollout measured."""
        ...

    def finish_step(self, step: int) -> PhaseReport | None:
        """After the update: the step's drafter phase report (None when none ran)."""
        ...

    def restore_drafter(self, state: dict) -> None:
        """A saved drafter trainer state (SpotTrainer.state_dict()) becomes `learning`'s newest, and its
        drafter the engines' (in-process at once, on a pool at the next rollout)."""
        ...

    def drafting_states(self) -> list[dict | None]:
        """The rollout side's checkpoint state: each worker's drafting state (its tuner's and its suffix
        calibration's, RolloutEngine.drafting_state), or None."""
        ...

    def load_drafting_states(self, states: list[dict | None]) -> None:
        ...

    def close(self) -> None:
        ...


def wants_hidden(params: Sequence, learning: DrafterLearning | None) -> list:
    if learning is None:
        return list(params)
    return [replace(p, return_hidden_states=True) for p in params]


class LocalRollout:
    def __init__(self, engine, learning: DrafterLearning | None, local_steps: int = 8) -> None:
        self.engine, self.learning, self.local_steps = engine, learning, local_steps
        self.workers = 1
        self._due = False  # the last training rollout asked for a phase

    def load_weights(self, state: dict, version: int) -> None:
        self.engine.load_weights(state, version)

    def restore_drafter(self, state: dict) -> None:
        self.learning.state = state
        self.engine.load_drafter(state["drafter"], self.learning.version)

    def generate(self, prompts, params, weights_version: int, step: int, learn: bool = True, history=None):
        """The step's outputs and engine stats; with `learn`, their features go to the drafter's buffer.
        `history` (HistoryDrafts) is what the suffix drafter drafts from besides the groups."""
        learning = self.learning if learn else None
        self.engine.reset_stats()
        outputs = self.engine.generate(prompts, wants_hidden(params, learning), weights_version=weights_version,
                                       history=history)
        stats = self.engine.rollout_stats
        if learning is not None:
            learning.add(outputs, weights_version)
            learning.schedule.observe(drafter_arms(stats))
            self._due = learning.due(step)
        return outputs, RolloutReport(stats)

    def finish_step(self, step: int) -> PhaseReport | None:
        """Train in place when due (on the critical path: there is no idle worker). Returns the phase report."""
        due, self._due = self._due, False
        if self.learning is None or not due or self.local_steps == 0:
            return None  # local_steps=0: no training on the critical path at all
        learning = self.learning
        config = replace(learning.config, max_steps=self.local_steps)
        records, weights = learning.payload()
        state, report = run_phase(self.engine.drafter, learning.state, records, weights, config, learning.seed + step)
        report.worker = 0
        learning.accept(state, report, step)
        if report.kept:  # the weights are in place already; this records the version and tells the tuner
            self.engine.load_drafter(learning.state["drafter"], learning.version)
        return report

    def drafting_states(self) -> list[dict | None]:
        return [self.engine.drafting_state()]

    def load_drafting_states(self, states: list[dict | None]) -> None:
        if states:
            self.engine.load_drafting_state(states[0])

    def close(self) -> None:
        if self.learning is not None:
            self.learning.close()


class PooledRollout:
    engine = None  # no engine in this process

    def __init__(self, pool, learning: DrafterLearning | None, log: Callable[[str], None] = print,
                 swap_every: int = 0) -> None:
        self.pool, self.learning, self.log = pool, learning, log
        self.swap_every = swap_every  # > 0: offer the drafter to tail workers every that many optimizer steps
        self.workers = len(pool)
        self.coordinator = Coordinator(len(pool))
        self.predictor = LengthPredictor()
        self._training: tuple[int, object] | None = None
        self._drafter_version = 0  # the drafter version every worker holds
        self._phase = 0  # spot phases started

    def load_weights(self, state: dict, version: int) -> None:
        self.pool.load_weights(state, version)

    def restore_drafter(self, state: dict) -> None:
        self.learning.state = state  # every worker takes it at the start of the next rollout

    def generate(self, prompts, params, weights_version: int, step: int, learn: bool = True, history=None):
        """The step's outputs (in prompt order) and their report; with `learn`, released workers train.
        Each worker gets the `history` (HistoryDrafts) of its share."""
        ray = self.pool.ray
        from ray.exceptions import RayActorError

        learning, coord = self.learning if learn else None, self.coordinator
        if self.learning is not None and self.learning.version != self._drafter_version:
            self.pool.load_drafter(self.learning.state["drafter"], self.learning.version)
            self._drafter_version = self.learning.version
        params = wants_hidden(params, learning)
        costs = [p.n * self.predictor.predict(q) for q, p in zip(prompts, params)]
        shares = assign(costs, self.workers)
        due = learning is not None and learning.due(step)
        coord.start_rollout()
        futures, results = {}, [None] * self.workers

        def submit(w: int) -> None:
            share = shares[w]
            futures[self.pool.actors[w].generate.remote([prompts[i] for i in share], [params[i] for i in share],
                                                        weights_version,
                                                        history.select(share) if history is not None else None)] = w

        for w in range(self.workers):
            submit(w)
        trainer = None
        while futures:
            ready, _ = ray.wait(list(futures), num_returns=1)
            w = futures.pop(ready[0])
            try:
                outputs, stats = ray.get(ready[0])
            except RayActorError as exc:
                self.log(f"rollout worker {w} died mid-rollout ({type(exc).__name__}); restarting it and "
                         f"generating its {len(shares[w])} prompts again")
                self.pool.restart(w)
                coord.restarted(w)
                submit(w)
                continue
            results[w] = (outputs, stats)
            if learning is not None:
                learning.add(outputs, weights_version)
            if coord.released(w, due):
                records, weights = learning.payload()
                ref = ray.put(records)
                seed = learning.seed + step
                self._phase += 1
                tail = [self.pool.actors[v] for v in coord.generating]
                trainer = (w, self.pool.actors[w].train.remote(self._phase, learning.state, ref, weights,
                                                               learning.config, seed, tail, self.swap_every))
        if trainer is not None:
            w, _ = trainer
            self.pool.actors[w].stop_training.options(concurrency_group="control").remote(self._phase)
            self._training = trainer
        ordered = [None] * len(prompts)
        for w, share in enumerate(shares):
            for i, out in zip(share, results[w][0]):
                ordered[i] = out
        for q, out in zip(prompts, ordered):
            self.predictor.observe(q, [len(c.token_ids) for c in out.outputs])
        merged = ShareStats.merge([r[1] for r in results])
        pool = PoolReport(coord.summary(), [len(s) for s in shares], self._drafter_version, merged.drafter_swaps,
                          due if learning is not None else None)
        if learning is not None:
            learning.schedule.observe(drafter_arms(merged.rollout))
        return ordered, RolloutReport(merged.rollout, pool)

    def finish_step(self, step: int) -> PhaseReport | None:
        """Collect the spot phase of this step's rollout (it stopped when rollout ended) and push the new
        drafter to every worker. Returns the phase report (None when no phase ran)."""
        if self._training is None:
            return None
        from ray.exceptions import RayActorError

        from ray.exceptions import GetTimeoutError

        w, future = self._training
        self._training = None
        self.coordinator.trainer_stopped()
        try:
            state, report = self.pool.ray.get(future, timeout=STOP_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as exc:
            what = "died" if isinstance(exc, RayActorError) else f"did not stop within {STOP_TIMEOUT_S:.0f}s"
            self.log(f"spot trainer on worker {w} {what}; its phase is lost, the drafter stays at the last "
                     "collected state, and the worker is replaced")
            self.pool.ray.kill(self.pool.actors[w])
            self.pool.restart(w)
            return PhaseReport(worker=w, lost=True)
        report.worker = w
        self.learning.accept(state, report, step)
        if self.learning.version != self._drafter_version:
            self.pool.load_drafter(self.learning.state["drafter"], self.learning.version)
            self._drafter_version = self.learning.version
        return report

    def drafting_states(self) -> list[dict | None]:
        return self.pool.collect_drafting()

    def load_drafting_states(self, states: list[dict | None]) -> None:
        if states and len(states) == self.workers:
            self.pool.load_drafting(states)
        elif states:
            self.log(f"drafting state of {len(states)} workers does not fit {self.workers} workers; "
                     "tuners and calibrations start fresh")

    def close(self) -> None:
        if self.learning is not None:
            self.learning.close()
        self.pool.close()


def rollout_layout(workers: int, worker_gpus: float, cores: int, gpus: int) -> tuple[int, float]:
    """(rollout workers, GPUs per Ray worker) for the `workers` and `worker_gpus` fields. workers=0 means
    one per core, except on a local machine whose trainer runs on CUDA (`gpus` > 0 visible GPUs): then
    one per GPU, each holding one (a single GPU gives the in-process engine on the trainer's device).
    Ray hides GPUs from actors that ask for none, so one-per-core workers there would decode on the CPU
    beside an idle GPU."""
    if workers:
        return workers, worker_gpus
    if gpus:
        return gpus, worker_gpus or 1.0
    return cores, worker_gpus


def make_rollout(config: "TrainConfig", policy, tokenizer, device, run_dir: Path | None = None,
                 log: Callable[[str], None] = print) -> RolloutBackend:
    """The in-process engine (one worker) or a pool of Ray workers for a GRPO run of `config`, with
    online drafter training when a learned drafter is in use and `drafter.train` is not off. `policy`
    (the trainer's model, on `device`) sizes a fresh drafter; drafter checkpoints go under `run_dir`."""
    import torch

    from tlt.model import load_model
    from tlt.rollout import EngineConfig, RolloutEngine

    c = config
    drafter = c.rollout_drafter()
    if c.speculative != "off" and c.drafter.model == "auto" and drafter is None:
        log(f"drafter.model=auto: no built-in drafter for {c.model}; speculating with n-gram drafts only "
            "(train one with tlt train-drafter and pass drafter.model=DIR, or drafter.model=random to learn one "
            "online from scratch)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus = torch.cuda.device_count() if device.type == "cuda" and c.ray_address is None else 0
    workers, worker_gpus = rollout_layout(c.workers, c.worker_gpus, cores, gpus)
    learning = None
    # drafter.attention_window none: "auto", from the window the drafter's config records (read by each
    # engine); a drafter learning online is also trained over drafter.window.
    window = "auto" if c.drafter.attention_window is None else c.drafter.attention_window or None
    if drafter is not None and c.drafter.train != "off":
        from tlt.config import import_callable
        from tlt.speculative.decoder import auto_window
        from tlt.speculative.drafter import Drafter, DrafterConfig

        drafter_config = DrafterConfig.for_target(policy) if drafter == "random" else Drafter.load(drafter, policy).config
        drafter_config = replace(drafter_config, train_window=max(drafter_config.train_window or 0, c.drafter.window))
        if window == "auto":
            window = auto_window(drafter_config.train_window)
        evict, sample = (import_callable(spec, f"field 'drafter.{name}'") if spec else None
                         for name, spec in (("buffer_evict", c.drafter.buffer_evict),
                                            ("buffer_sample", c.drafter.buffer_sample)))
        learning = DrafterLearning(c.drafter, drafter_config, Path(run_dir) / "drafter" if run_dir is not None else None,
                                   log, evict=evict, sample=sample, seed=c.seed)
    engine = EngineConfig(max_batch_size=c.max_batch_size, seed=c.seed, speculative=c.speculative,
                          strategy=c.strategy, tuner=c.tuner if c.speculative == "adaptive" else None,
                          catch_up_window=c.drafter.catch_up_window or None, drafter_window=window, drafter=drafter,
                          drafter_bits=c.drafter.bits)
    if workers == 1:
        model = load_model(c.model, dtype=c.rollout_dtype, device=device)
        if drafter == "random":
            from tlt.speculative.drafter import Drafter

            drafter = Drafter.from_target(model, seed=c.seed).eval()
        return LocalRollout(RolloutEngine(model, tokenizer, replace(engine, progress=c.log.progress, drafter=drafter)),
                            learning, c.drafter.local_steps)
    from tlt.spot.workers import RayPool, WorkerSpec

    threads = c.worker_threads or max(1, (c.threads or cores) // workers)
    specs = [WorkerSpec(c.model, replace(engine, seed=c.seed + w), threads, dtype=c.rollout_dtype, seed=c.seed)
             for w in range(workers)]
    # On a cluster each worker reserves a CPU so Ray spreads them over machines; on the local cluster
    # threads are set here, and reserving none lets several pools (a benchmark's runs) coexist.
    pool = RayPool(specs, c.ray_address, cpus_per_worker=1 if c.ray_address else 0,
                   gpus_per_worker=worker_gpus, log=log)
    each = f"{threads} thread(s)" + (f", {worker_gpus:g} GPU" if worker_gpus else "")
    log(f"rollout on {workers} Ray workers ({each} each)"
        + (f", drafter trained on released workers ({c.drafter.train})" if learning is not None else ""))
    return PooledRollout(pool, learning, log, swap_every=c.drafter.hot_swap_every)
