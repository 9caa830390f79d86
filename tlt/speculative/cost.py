"""What one more verified draft token costs, measured per live-batch bucket: the floor of an auto-pruned suffix draft.

A draft node is worth verifying when the token it may add is worth more than the time it costs. Suffix draft
nodes carry calibrated acceptance probabilities (suffix.Calibration: p, the chance the target takes the node's
whole path), so a node adds p tokens on average. If a step over N verified tokens (roots included) at B live
rows takes about t = a + b B + c N seconds, one more node costs c seconds, and the step's tokens come at
r tokens a second, the node pays for itself when p > c r. That product is the floor a draft should be cut at,
and it is a property of the host and the batch, not of the drafter: on the 2-core AMX Xeon, where a product
over up to 16 rows costs what one row does, a suffix tree cut at 25% rolled out faster than one cut at 50%;
on the 2-core EPYC without AMX the 50% cut won (docs/results/README.md, "Calibrated suffix drafts" and "A
lower floor on this host, and a floor set by the measured cost").

`StepCosts` fits t = a + b B + c N by least squares over the model-free steps of each bucket (plain steps have
N = B, n-gram and suffix steps more; a learned drafter's steps also pay its forwards, which the fit would charge
to their verified tokens, so they are left out), their weights decaying by `DECAY` a step of the bucket so the fit
follows the growing contexts of a rollout, and keeps the bucket's tokens a second under the same decay. The
floor is c r clamped to [MIN_FLOOR, MAX_FLOOR], or `PRIOR_FLOOR` until the bucket has seen `MIN_STEPS` steps
whose tokens a row differ enough to tell c from b (a bucket of plain steps alone cannot).
It decides drafts only: verification is target-only, so the samples do not depend on it. On the AMX host's
64-problem x 4-epoch RL bench the tuner with `suffix-d16-v32-pa-c1` rolled out 1.11x as fast as without it, between
the fixed 50% (1.08-1.09x) and 25% (1.13x) floors: the fit does not yet beat the best fixed floor it stands for.
"""

from __future__ import annotations

import math

import numpy as np

DECAY = 0.98  # weight of a step's measurement per later step of its bucket (about 50 steps of memory)
MIN_STEPS = 16  # decayed steps a bucket needs before its own fit sets the floor
MIN_SPREAD = 0.25  # least weighted spread (standard deviation) of verified tokens a row that identifies c
PRIOR_FLOOR = 0.25  # the floor before a bucket's fit is trusted
MIN_FLOOR, MAX_FLOOR = 0.02, 0.9
RIDGE = 1e-9  # keeps the normal equations solvable when a bucket's batch size never varies


def power_of_two_bucket(rows: int) -> int:
    """Power-of-two buckets of the live batch size: 1 | 2 | 3-4 | 5-8 | 9-16 | ... (the tuner's default buckets)."""
    return max(rows - 1, 0).bit_length()


class _Fit:
    """Decayed sums for least squares of seconds on x = (1, rows, verified tokens): X'X, X't (whose first entries are
    the decayed step count and seconds), the emitted tokens and the sums of verified tokens a row and its square."""

    def __init__(self) -> None:
        self.xx = np.zeros((3, 3))
        self.xt = np.zeros(3)
        self.tokens = 0.0
        self.per_row = np.zeros(2)
        self.least_rows = 0  # the smallest batch size recorded (the bucket's label in stats)

    @property
    def weight(self) -> float:
        return float(self.xx[0, 0])

    @property
    def seconds(self) -> float:
        return float(self.xt[0])

    def add(self, rows: int, verified: int, emitted: int, seconds: float) -> None:
        x = np.array([1.0, rows, verified])
        self.least_rows = min(self.least_rows, rows) if self.least_rows else rows
        per_row = verified / rows
        self.xx = DECAY * self.xx + np.outer(x, x)
        self.xt = DECAY * self.xt + x * seconds
        self.tokens = DECAY * self.tokens + emitted
        self.per_row = DECAY * self.per_row + (per_row, per_row * per_row)

    def spread(self) -> float:
        """Weighted standard deviation of verified tokens a row."""
        mean, square = self.per_row / self.weight
        return math.sqrt(max(square - mean * mean, 0.0))

    def token_cost(self) -> float:
        """c of the fit: seconds per verified token at a fixed batch size."""
        ridge = RIDGE * self.xx.diagonal().max() * np.eye(3)
        return float(np.linalg.solve(self.xx + ridge, self.xt)[2])


class StepCosts:
    """Per live-batch bucket, the fit of step seconds on batch size and verified tokens (module docstring).
    `bucket_of` maps a batch size to its bucket: the adaptive engine passes its tuner's, so the floor of a bucket
    is fitted over the steps the tuner's bandit of that bucket sees."""

    def __init__(self, bucket_of=power_of_two_bucket) -> None:
        self.fits: dict[int, _Fit] = {}
        self.bucket_of = bucket_of

    def record(self, rows: int, verified: int, emitted: int, seconds: float) -> None:
        """One decode step: its live rows, tokens its forward verified (the rows' roots included), tokens it
        emitted and its seconds."""
        if rows > 0 and seconds > 0:
            self.fits.setdefault(self.bucket_of(rows), _Fit()).add(rows, verified, emitted, seconds)

    def floor(self, rows: int) -> float:
        """The least calibrated path probability worth verifying at `rows` live rows: c r (module docstring)."""
        fit = self.fits.get(self.bucket_of(rows))
        if fit is None or fit.weight < MIN_STEPS or fit.spread() < MIN_SPREAD:
            return PRIOR_FLOOR
        return min(MAX_FLOOR, max(MIN_FLOOR, fit.token_cost() * fit.tokens / fit.seconds))

    def stats(self) -> dict[str, dict[str, float]]:
        """Per bucket (the smallest batch size recorded in it), the fitted seconds per verified token, tokens a
        second and floor."""
        out = {}
        for _, fit in sorted(self.fits.items()):
            rows = fit.least_rows
            out[str(rows)] = {"token_ms": 1000 * fit.token_cost(), "tokens_per_s": fit.tokens / fit.seconds,
                              "floor": self.floor(rows), "steps": fit.weight}
        return out
