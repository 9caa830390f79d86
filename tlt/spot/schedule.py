"""When released workers train the drafter (`Schedule`, by the `train` setting).

"every" RL step, "every-N" (`train_every` steps apart), or "acceptance" (the default), which trains
while the drafter is behind or still learning: when no acceptance length has been measured yet, when the
current level fell below `train_fraction` of the best level seen (the policy moved away from the
drafter), or when it beat the previous best by more than 2% (the last phase helped, so the drafter has
not converged: a cold-started drafter keeps training until it plateaus). A converged drafter under a
slowly moving policy trains only when its acceptance drops.

Levels are kept per arm (strategy that drafts with the learned drafter): an adaptive rollout mixes arms
whose acceptance lengths differ by 3x (the bench policy: tree-d2-k1-v2 2.2 tokens a step, tree-d8-k2-v12
6.5), in a mix that follows the live batch sizes of that step's responses, so one figure over all arms
swings with the mix, not the drafter (a frozen drafter's reads 2.8 to 6.2 across 20 GRPO steps), and a
schedule judging it sees the drafter behind or improving at most steps. An arm's level is the median of
its last 3 measurements, however many rollouts apart: an arm the tuner left for a while shows a drop after
two of its runs, as an arm that runs every step does, and a level of one rollout's figure would make
every returning arm a training phase. Its best level fades by 1% per rollout that measures it unless
renewed: one rollout's figure swings with its samples, and the all-time best is an extreme of that noise. A decision weighs each
arm of the last rollout by its row-steps: the drafter is behind when the weighted level over best falls
below `train_fraction`, improving when the weighted level over the previous best exceeds 1.02, or when
none of the rollout's arms had been measured before (a first measurement, as at the start). The first phase
waits until the buffer holds `min_pairs` pairs.
"""

from __future__ import annotations

import math
import statistics

from tlt.errors import CheckpointError
from tlt.spot.config import SpotConfig

IMPROVEMENT = 0.02  # a new best by more than this fraction means the drafter is still learning
LEVEL_OF = 3  # rollouts whose median acceptance is an arm's level
BEST_FADE = 0.99  # an arm's best level, unless renewed, shrinks by this factor per rollout that measures it
ANY = "*"  # the one arm of a state saved when the level was not kept per arm


class Schedule:
    """Decides, per RL step, whether released workers train the drafter (see the module docstring)."""

    def __init__(self, config: SpotConfig) -> None:
        self.config = config
        self.best: dict[str, float] = {}  # per arm: the best level seen (fading)
        self.recent: dict[str, list[float]] = {}  # per arm: its last LEVEL_OF measurements
        self.weights: dict[str, int] = {}  # the last measured rollout's row-steps per arm
        self.improving = True

    def level(self, arm: str) -> float | None:
        """An arm's level: the median of its recent measurements (None before any)."""
        recent = self.recent.get(arm)
        return statistics.median(recent) if recent else None

    @property
    def behind(self) -> float | None:
        """The last rollout's arms' levels over their best, weighted by row-steps (None before any)."""
        if not self.weights:
            return None
        total = sum(self.weights.values())
        return sum(w * self.level(a) / self.best[a] for a, w in self.weights.items()) / total

    def observe(self, arms: dict[str, tuple[float | None, int]]) -> None:
        """The rollout that just ended: per arm, (acceptance length, row-steps) (`drafter_arms` in
        spot/rollout.py; empty: no drafter step ran, nothing changes)."""
        # acceptance lengths are at least 1 token a step; an arm with no row-steps measured nothing
        measured = {a: (float(x), int(n)) for a, (x, n) in arms.items()
                    if n > 0 and x is not None and math.isfinite(x) and x > 0}
        if not measured:
            return
        if ANY not in measured:  # per-arm measurements replace a state saved as one level
            for table in (self.best, self.recent):
                table.pop(ANY, None)
        gain = weight = 0.0
        for arm, (x, n) in measured.items():
            self.recent[arm] = (self.recent.get(arm, []) + [x])[-LEVEL_OF:]
            level, best = self.level(arm), self.best.get(arm)
            if best is not None:
                gain, weight = gain + n * level / best, weight + n
            self.best[arm] = level if best is None else max(best * BEST_FADE, level)
        self.improving = weight == 0 or gain / weight > 1 + IMPROVEMENT
        self.weights = {a: n for a, (_, n) in measured.items()}

    def due(self, step: int, buffered_pairs: int) -> bool:
        c = self.config
        if c.train == "off" or buffered_pairs < c.min_pairs:
            return False
        if c.train == "every":
            return True
        if c.train == "every-N":
            return step % c.train_every == 0
        return not self.weights or self.improving or self.behind < c.train_fraction

    def state_dict(self) -> dict:
        return {"best": dict(self.best), "recent": {a: list(r) for a, r in self.recent.items()},
                "weights": dict(self.weights), "improving": self.improving}

    def load_state_dict(self, state: dict) -> None:
        """States saved before levels were kept per arm (one best, a "recent" list or a single "last"
        measurement) load as the one arm ANY."""
        self.improving = state.get("improving", True)
        best, recent = state.get("best"), state.get("recent")
        if isinstance(best, dict):
            self.best = {a: float(v) for a, v in best.items()}
            self.recent = {a: [float(x) for x in r] for a, r in (recent or {}).items()}
            self.weights = {a: int(n) for a, n in state.get("weights", {}).items()}
            unknown = sorted(a for a in self.weights if a not in self.best or not self.recent.get(a))
            if unknown:
                raise CheckpointError(f"drafter schedule state: arms {unknown} are weighed but have no level")
            return
        old = recent if recent is not None else ([] if state.get("last") is None else [state["last"]])
        self.best = {} if best is None else {ANY: float(best)}
        self.recent = {ANY: [float(a) for a in old]} if old else {}
        self.weights = {ANY: 1} if old and best is not None else {}
