"""When released workers train the drafter (`Schedule`, by the `train` setting).

"every" RL step, "every-N" (`train_every` steps apart), or "acceptance" (the default), which trains
while the drafter is behind or still learning: when no acceptance length has been measured yet, when the
current level fell below `train_fraction` of the best level seen (the policy moved away from the
drafter), or when it beat the previous best by more than 2% (the last phase helped, so the drafter has
not converged: a cold-started drafter keeps training until it plateaus). A converged drafter under a
slowly moving policy trains only when its acceptance drops. The level is the median of the last 3
rollouts' acceptance lengths, and the best level fades by 1% per rollout unless renewed: one rollout's
figure swings with which arms the tuner ran and on which samples, so with single rollouts judged against
the all-time best (an extreme of that noise, creeping upward) noise alone would make most steps of a
converged run train. The first phase waits until the buffer holds `min_pairs` pairs.
"""

from __future__ import annotations

import math
import statistics

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
