"""StepCosts: the fitted seconds per verified token and the floor of auto-pruned suffix drafts."""

import random

import pytest

from tlt.speculative.cost import MAX_FLOOR, MIN_FLOOR, MIN_STEPS, PRIOR_FLOOR, StepCosts, power_of_two_bucket


def steps(costs, a, b, c, rows_range, per_row_range, accept, n=200, noise=0.0, seed=0):
    """Record `n` steps of t = a + b B + c N (times 1 + noise), B rows from rows_range, N = B x tokens a row,
    emitting `accept` tokens a verified token. Returns tokens / seconds over them."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(n):
        rows = rng.randint(*rows_range)
        verified = round(rows * rng.uniform(*per_row_range))
        t = (a + b * rows + c * verified) * (1 + rng.uniform(-noise, noise))
        emitted = max(rows, round(accept * verified))
        costs.record(rows, verified, emitted, t)
        tokens, seconds = tokens + emitted, seconds + t
    return tokens / seconds


def test_buckets_are_the_tuners_powers_of_two():
    assert [power_of_two_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7]


def test_the_fits_follow_the_buckets_given():
    """With a tuner's buckets (here 1-4 | 5-32 | 33-), steps at 5 and 30 rows share one fit, and its stats are
    labelled by the smallest batch size recorded in it."""
    from tlt.adaptive import Tuner, TunerConfig

    tuner = Tuner(TunerConfig(buckets=(4, 32)))
    costs = StepCosts(tuner.bucket_of)
    for rows in (5, 30, 12, 40):
        costs.record(rows, 2 * rows, rows, 0.01)
    assert sorted(costs.fits) == [1, 2]
    assert costs.fits[1].weight == pytest.approx(1 + 0.98 + 0.98 ** 2)
    assert sorted(costs.stats()) == ["40", "5"]


def test_the_floor_is_the_fitted_token_cost_times_the_rate():
    costs = StepCosts()
    steps(costs, 0.004, 0.0008, 0.00012, (9, 16), (1.0, 5.0), 0.6, noise=0.05)
    fit = costs.fits[power_of_two_bucket(12)]
    assert fit.token_cost() == pytest.approx(0.00012, rel=0.15)
    assert costs.floor(12) == pytest.approx(fit.token_cost() * fit.tokens / fit.seconds, rel=1e-9)
    assert costs.stats()["9"]["token_ms"] == pytest.approx(0.12, rel=0.15)
    assert costs.floor(40) == PRIOR_FLOOR  # another bucket has seen nothing


def test_a_dearer_token_raises_the_floor():
    cheap, dear = StepCosts(), StepCosts()
    steps(cheap, 0.004, 0.0008, 0.00005, (5, 8), (1.0, 4.0), 0.6)
    steps(dear, 0.004, 0.0008, 0.0004, (5, 8), (1.0, 4.0), 0.6)
    assert MIN_FLOOR <= cheap.floor(6) < dear.floor(6) <= MAX_FLOOR


def test_the_prior_holds_until_the_fit_can_tell_token_cost_from_row_cost():
    costs = StepCosts()
    steps(costs, 0.004, 0.0008, 0.0001, (3, 4), (1.0, 4.0), 0.6, n=MIN_STEPS - 4)
    assert costs.floor(4) == PRIOR_FLOOR  # too few steps
    plain = StepCosts()
    steps(plain, 0.004, 0.0008, 0.0001, (3, 4), (1.0, 1.0), 1.0)
    assert plain.floor(4) == PRIOR_FLOOR  # plain steps alone: one token a row, c is not identified


def test_the_floor_is_clamped():
    free, ruinous = StepCosts(), StepCosts()
    steps(free, 0.004, 0.0008, -0.0001, (5, 8), (1.0, 4.0), 0.6)  # a negative fitted cost (noise) floors at MIN
    steps(ruinous, 0.0001, 0.0, 0.05, (5, 8), (1.0, 4.0), 0.9)
    assert free.floor(6) == MIN_FLOOR and ruinous.floor(6) == MAX_FLOOR


def test_old_steps_fade():
    """The fit follows a cost that changes (contexts grow through a rollout): after enough steps at the new
    cost, the old one hardly counts."""
    costs = StepCosts()
    steps(costs, 0.004, 0.0008, 0.0004, (5, 8), (1.0, 4.0), 0.6)
    steps(costs, 0.004, 0.0008, 0.0001, (5, 8), (1.0, 4.0), 0.6, n=300, seed=1)
    assert costs.fits[power_of_two_bucket(6)].token_cost() == pytest.approx(0.0001, rel=0.05)
