"""The coordinator: which rollout worker is doing what during one rollout, and who may train.

A worker's life in one rollout:

    IDLE --start--> GENERATING --finished its share--> RELEASED --train--> TRAINING --stop--> DONE
                         ^   |                            |                                   |
                         +---+ restart (it died)          +---- nothing to do --------------> DONE
    DONE / IDLE --start (next rollout)--> GENERATING

A worker is released when its share is generated. If other workers are still generating (the long
tail) and training is due, the first released worker becomes the spot trainer; others go straight to
DONE (one trainer at a time: the drafter is small, and a second one would need data-parallel
training to share its updates). When the last worker finishes, rollout is over: the trainer is asked
to stop, and it stops within part of one optimizer step. Every transition is checked, so an impossible
event (a result from a worker that was never started) is a loud error rather than a silently wrong rollout.
The timeline (worker, state, time) is kept for the metrics: idle and training seconds per worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum

from tlt.errors import TrainingError


class WorkerState(str, Enum):
    IDLE = "idle"
    GENERATING = "generating"
    RELEASED = "released"
    TRAINING = "training"
    DONE = "done"


ALLOWED = {
    WorkerState.IDLE: {WorkerState.GENERATING},
    WorkerState.GENERATING: {WorkerState.RELEASED, WorkerState.GENERATING},  # the loop: a restart
    WorkerState.RELEASED: {WorkerState.TRAINING, WorkerState.DONE},
    WorkerState.TRAINING: {WorkerState.DONE},
    WorkerState.DONE: {WorkerState.GENERATING},
}


@dataclass
class WorkerTimes:
    """Per worker, over one rollout: seconds generating, training and idle, and restarts so far."""

    generating_s: list[float]
    training_s: list[float]
    idle_s: list[float]
    restarts: list[int]


class Coordinator:
    def __init__(self, workers: int, clock=time.perf_counter) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.clock = clock
        self.states = [WorkerState.IDLE] * workers
        self.timeline: list[tuple[int, WorkerState, float]] = []
        self.restarts = [0] * workers
        self.trainer: int | None = None
        self.rollout_started: float | None = None
        self.rollout_ended: float | None = None

    def _move(self, w: int, new: WorkerState) -> None:
        old = self.states[w]
        if new not in ALLOWED[old]:
            raise TrainingError(f"worker {w}: cannot go from {old.value} to {new.value}")
        self.states[w] = new
        self.timeline.append((w, new, self.clock()))

    @property
    def generating(self) -> list[int]:
        return [w for w, s in enumerate(self.states) if s is WorkerState.GENERATING]

    @property
    def rollout_active(self) -> bool:
        return self.rollout_started is not None and self.rollout_ended is None

    def start_rollout(self) -> None:
        if self.rollout_active:
            raise TrainingError("a rollout is already running")
        self.timeline, self.trainer = [], None
        self.rollout_started, self.rollout_ended = self.clock(), None
        for w in range(len(self.states)):
            self._move(w, WorkerState.GENERATING)

    def restarted(self, w: int) -> None:
        """Worker w died mid-rollout and was replaced; it generates its share again."""
        self._move(w, WorkerState.GENERATING)
        self.restarts[w] += 1

    def released(self, w: int, training_due: bool) -> bool:
        """Worker w finished its share. Returns True when it should become the spot trainer: training is
        due, no other worker trains, and some worker is still generating (there is idle time to use)."""
        self._move(w, WorkerState.RELEASED)
        if training_due and self.trainer is None and self.generating:
            self._move(w, WorkerState.TRAINING)
            self.trainer = w
            return True
        self._move(w, WorkerState.DONE)
        if not self.generating:
            self.rollout_ended = self.clock()
        return False

    def trainer_stopped(self) -> None:
        if self.trainer is None:
            raise TrainingError("no worker is training")
        self._move(self.trainer, WorkerState.DONE)

    def summary(self) -> WorkerTimes:
        """Seconds each worker spent generating and training in this rollout, and its idle seconds
        (released or done while the rollout was still running)."""
        end = self.rollout_ended if self.rollout_ended is not None else self.clock()
        out = WorkerTimes([], [], [], list(self.restarts))
        for w in range(len(self.states)):
            events = [(s, t) for v, s, t in self.timeline if v == w] + [(None, end)]
            spent = {WorkerState.GENERATING: 0.0, WorkerState.TRAINING: 0.0}
            idle = 0.0
            for (state, t0), (_, t1) in zip(events, events[1:]):
                t1 = min(t1, end)
                if state in spent:
                    spent[state] += max(t1 - t0, 0.0)
                elif state is not None:
                    idle += max(t1 - t0, 0.0)
            out.generating_s.append(spent[WorkerState.GENERATING])
            out.training_s.append(spent[WorkerState.TRAINING])
            out.idle_s.append(idle)
        return out
