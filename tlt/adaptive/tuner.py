"""The bucketed multi-armed bandit that picks each decode step's strategy: TLT's BEG-MAB (bucketed
epsilon-greedy), with upper confidence bounds in place of epsilon draws by default.

Arms are `Strategy` objects, named in the config ("off", "ngram-d4", "tree-d6-k4-v24", ...) and in
`stats()` and `state_dict()`, the tuner's JSON. What an arm earns depends mostly on
the live batch size: verifying 48 tree nodes per row is nearly free at batch 1 and ruinous at batch 64.
So the tuner keeps one independent bandit per batch-size bucket. `buckets` are upper bounds: a batch
of size b falls in the first bucket whose bound is >= b, and one open bucket past the last bound
catches everything larger. The default, powers of two to 256, gives buckets 1 | 2 | 3-4 | 5-8 | ... |
129-256 | >256: no bucket but the open one spans more than twice its smallest batch size, as the arm that
wins changes within such a span (the bench policy's 16 x 8 rollout: trees win up to about 40 live rows,
plain decoding from about 64).

Inside a bucket, `choose` runs:
1. Untried arms first, in config order (an untried arm scores +inf), so every arm is measured once
   before any is trusted.
2. Exploration. With `explore="ucb"` (the default) the arm of the highest upper bound
   log score + ucb x spread x sqrt(ln n / n_arm), where n_arm is the decayed weight of the arm's rewards
   (their count when decay = 1), n the candidates' together, and spread the bucket's robust spread of one
   step's log reward about its arm's median (1.4826 x the median absolute deviation, refitted with the row
   slope); under `spread="arm"` the larger of that and the arm's own spread (as UCB1-Tuned scales each
   arm's bound by its own variance; "Spreads" below); `epsilon` is unused. With `explore="cost"` or
   `"uniform"`, with probability `epsilon` / `explore_run` an exploration draw: a uniformly random arm (the
   greedy one included); under "cost" a drawn arm whose steps take longer than the greedy arm's runs only
   with probability seconds(greedy) / seconds(arm), the median step times of the two in the bucket, and the
   step is greedy otherwise; under "uniform" it always runs (textbook epsilon-greedy). Without step times (`update` called without
   `seconds`) the reward ratio score(arm) / score(greedy) stands in: the two agree when every arm emits
   the same tokens per step. An explored arm runs for `explore_run` steps of the bucket.
3. Otherwise the arm with the best score, ties going to the arm listed first.
An untried arm also runs for `explore_run` steps.

Why upper bounds. Epsilon explores at a flat rate: plain decoding at 25 live rows under a good drafter,
2.5x below the greedy deep tree, is re-measured as often as a rival within 10% of it, and every exploration
step also costs the greedy arm's next step its footing (below). Under the bound an arm far below the greedy
one waits until its rewards have decayed before it is measured again, a close rival is measured often, and
decay keeps any arm's bound from closing for good while the drafter changes (the discounted UCB of
non-stationary bandits). Bench policy, 16 x 8 rollout, side by side in five runs: 1.93x, 1.95x, 1.76x, 1.70x and
2.02x plain decoding against 1.73x, 1.81x, 1.86x, 1.92x and 1.88x for "cost" at epsilon 0.1; fifteen rollouts each
pooled, 1.92x against 1.88x, within the host's spread (docs/results/bench_rollout_ucb*.json); with the fused silu
and one-pass masks, four more runs: 2.35x, 1.89x, 1.96x, 1.82x against 2.06x, 2.03x, 2.05x, 1.71x, twelve rollouts
pooled 1.91x against 1.93x (bench_rollout_onepass_masks*.json); with attention that fetches ahead, five more:
2.00x, 1.98x, 1.95x, 1.89x, 1.93x against 1.77x, 1.84x, 2.03x, 1.82x, 1.76x, fifteen rollouts pooled 1.99x against
1.88x (bench_rollout_attention_ahead*.json). At 17-32 rows the bounds ran plain decoding 3-4 times a rollout where
epsilon draws did 17-22 times, and the shallow tree-d4-k1-v4 11-67 times where epsilon draws ran it 175-409 times in
three runs of four.

Spreads (`spread`). The bucket's spread pools every arm's rewards, so the arm with the most of them, the
greedy one, sets it, while arms' own spreads differ several-fold within a bucket (default policy, 16 x 8
rollout on a Zen 3, docs/results/bench_rollout_default_spread_arm_zen3.json: at one live row from 0.18 in log
reward for plain decoding to 1.09 for tree-d4-k1-v4, where the greedy tree-d4-k2-v8's rewards set the
bucket's). A rival noisier than the greedy arm then gets a bound as narrow as a steady arm's: after one
poor draw it waits until that reward's weight has decayed, and again after every poor draw. With
`spread="arm"` its own spread widens its bound once it has two rewards, so it is measured again soon and
judged on several (synthetic streams: a suffix arm 30% faster than plain decoding but
noisy, forgotten and re-measured, was kept out of most of the next 150 steps in 13 of 40 streams under
the bucket's spread, in 2 of 40 under its own); a noisy arm that is worse is measured more often too.
"bucket" stays the default: on the default policy and on the bench policy's history runs the two were within
one run's spread (docs/results/README.md, "Scaling each arm's bound by its own spread").

Runs, and the step after a switch (`explore_run`). What a step earns depends on the arm before it: a
step starts where the previous one's accepted path ended, and a deep tree run step after step settles
where its drafts fail (in the bench task, at the digit a chain step computes) and spans what follows,
while its first step after a shallow arm starts anywhere (bench policy, 16 x 8 rollout, 9-32 live rows:
tree-d8-k2-v12 accepts 5.8 tokens a row on its first step after tree-d4-k1-v4 steps, 7.5 on the next
three, 7.7 in a rollout of its own). A bandit that explores single steps measures every arm in the
greedy arm's place and ranks it below what running it would give. So an exploration can keep its arm for
a run of steps, and a step whose arm differs from the bucket's previous step's (any arm, greedy too) is
then not scored; its step time still counts for `explore="cost"`. explore_run = 1 (the default) explores
single steps and scores every step: on the bench rollout, epsilon draws in runs of N = 4 or 8 ran no
faster (docs/results/bench_rollout_explore_runs.json), nor did upper bounds with runs of 2 (1.76x against
1.93x at runs of 1, in the first of the runs above).

Why "cost": at large batch one step of a slow arm (a tree verification of 128 rows, plus the drafter's
catch-up over the pairs the plain steps queued) costs many plain steps, so uniform exploration there
can cost more than speculation saves. Weighting each draw by the step-time ratio caps what a draw
costs at about one greedy step's time, however slow the arm, while arms about as fast as the greedy
one, the only ones that can overtake it, run at the full rate.

Only arms not pruned from the bucket and accepted by the caller's `allowed` predicate compete: the
engine uses it for a memory guard (draft tokens x batch) and to drop drafter arms when no drafter is
loaded.

The reward of a step is accepted tokens per second (tokens emitted / step time). An arm's score is the
median of the last `window` rewards it earned in that bucket: step times are heavy-tailed (a step
that also prefills, an allocator pause), and a median shrugs them off where a mean would not. A draft
arm's tokens per step skew right, though (most steps take little of a draft, a few take most of it), and
there the median ranks it below the tokens a second it decodes; `score="mean"` ranks (and reports) by the
mean instead, which equals an arm's tokens a second where its steps at one batch size take about equal
times, as a fixed arm's do. Under it everything below said of medians holds of means (the keys of
`stats()` and the pruning records keep the name "median").

Rows within a bucket (`row_slope`). A bucket spans a range of live batch sizes (65-128 rows at the start
of a 16 x 8 rollout), and a step's tokens per second grow with its rows whatever the arm, while a
rollout's rows only fall as responses end. Raw rewards would then compare an arm explored early, at many
rows, with one run late, at few, and favour whichever was measured earlier. So every reward is stored
with its batch size, and each bucket fits one slope of log reward on log batch size, pooled over its
arms' windows (each arm about its own means, so a difference between arms does not count as a slope;
clamped to [0, 1]: more rows never cost throughput, nor speed a step up), refitted every `SLOPE_EVERY`
rewards. Medians are taken over rewards moved along that slope to the bucket's smallest batch size, so
arms are ranked, pruned and reported as at one batch size. With one batch size per bucket (or
row_slope=False) the slope is 0 and scores are the plain medians.

Forgetting (`decay`). The drafter is retrained between RL steps, so what an arm earns drifts, mostly
upward. Two mechanisms follow it:
- The window: rewards older than the last `window` samples of an arm drop out.
- Decay: every reward is stamped with the bucket's step counter (how many rewards the bucket had
  recorded before it), and the score is the *weighted* median of the window with weight
  decay ** (counter now - stamp). decay = 1 is the plain sliding-window median; below 1, a reward's
  say halves every ln 2 / -ln(decay) bucket steps (the default 0.99: about 69).
The clock is the bucket's, not the arm's. The greedy arm is rewarded nearly every step, so it forgets
at that rate whatever the clock. An arm that is only explored now and then carries old rewards, spaced
far apart (about arms / epsilon steps under epsilon draws), so its next exploration sample outweighs its
stale history: an arm that was poor under last step's drafter is re-judged on fresh evidence instead of having to
re-fill half its window at the exploration rate first. It pays within a rollout too, with the drafter fixed: on the
2-core EPYC's bench 16 x 8 rollout, decay 1 and 0.999 ran 1.05x and 1.08x plain decoding against 1.26x at 0.99 (one
run, docs/results/bench_rollout_epyc_decay.json), running shallower arms at 17-32 live rows. Weights only matter
relative to each other (the median is unchanged when all weights are scaled), so an arm's score changes only when its
own window does (or the bucket's row slope), and is cached.

Pruning. Once an arm and the bucket's best arm both have at least `prune_after` rewards in their
windows, an arm whose plain window median is below `prune_ratio` x the best plain median is pruned
from that bucket for good: it is neither exploited nor explored there again, which stops exploration from
paying for a shape that cannot win (a 48-node tree at batch 32). Pruning is permanent, so it compares
undecayed medians over whole windows rather than the decayed scores, which for a rarely explored arm
rest on its last few rewards. Each pruning is reported through `log` and recorded in `stats()`.
prune_ratio = 0 disables it.

History. Arms that draft from earlier responses to the prompt (suffix, hybrid) draft from the group alone
until the run first sees a prompt again, and what they earned then says little about them after: on the bench
policy, from a cold start over three epochs, a tuner with suffix-d16-v32-p30-c1 and -p50-c1 ran plain decoding
in most steps at 16-32 live rows, where in that run's day from the second epoch on -p50-c1 decoded 8-30% faster
than plain decoding (docs/results/README.md, "Calibrated suffix drafts"). The first rollout that brings earlier
responses makes the tuner forget those arms' rewards and prunings in every bucket (`forget`, called by the
adaptive decoder; `history_seen` in the state), so they are measured again as untried. In one such run -p50-c1
then ran 138 of 769 steps at 17-32 rows (4 of 930 without it), though the rollout was no faster than the runs
without it (1.11x against 1.14x and 1.17x over the default arms, within their spread). A history arm's first
step after forgetting decides for a while: under upper bounds, one poor reward keeps an arm out of a bucket until
its weight has decayed (in one run, 403 steps of plain decoding at 9-16 rows, about 1.5% of the rollout).

"off" is an arm in every bucket and is never pruned: the batch size at which speculation starts to pay
is measured per bucket (and per drafter quality), not guessed as a fixed threshold, and there is
always an arm left that any guard allows.

State. `state_dict()` is plain JSON (config, windows, counters, the random stream), and a tuner
restored from it makes the same choices the original would have made.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from tlt.config import check, check_choice, check_int, check_numbers, from_dict, setting
from tlt.errors import ConfigError, FieldError
from tlt.speculative.strategy import Strategy

# Every default arm verifies target-only (verify.walk: trees, and n-gram chains), whose draws are plain
# sampling's own, so an adaptive rollout returns the very samples plain decoding would (token for token
# given equal logits), not merely samples of the same distribution: a tlt RL run is the baseline run,
# faster. Chains with speculative sampling ("chain-d4") keep the distribution but draw other samples;
# they stay available as arms. The trees cover the batch sizes where drafting pays: the deep
# tree-d8-k2-v8 where a drafter trained on its own features keeps whole chains right (the bench
# policy's 16 x 8 rollout: 6.3 tokens accepted a step, 1.94-2.05x plain decoding fixed, the tuner
# 1.80-2.09x in three runs; tree-d8-k2-v12 accepts 6.65 at 1.46-1.75x: its 4 more nodes a row
# add 44% to the verification's tokens for 5% more accepted, docs/results/bench_rollout_deep_v8*.json),
# tree-d4-k2-v8 where it does not; the top-1 chain tree-d4-k1-v4 accepts as much as chain-d4 at less
# cost; off wins at large batch (`tlt bench speculative --strategies ...` compares shapes). n-gram
# drafting stays for cold start and for the loops a sampled policy falls into.
DEFAULT_ARMS = ("off", "ngram-d4", "tree-d4-k1-v4", "tree-d4-k2-v8", "tree-d8-k2-v8")

STATE_VERSION = 4  # version 1 holds no step times, 1-2 no batch sizes, 1-3 no runs; all load without them
EXPLORE = ("cost", "uniform", "ucb")
SCORES = ("median", "mean")
SPREADS = ("bucket", "arm")
STEP_TIMES = 16  # step times kept per arm and bucket for explore="cost"
SLOPE_EVERY = 32  # rewards a bucket records between fits of its row slope (a fit reads every window)


@dataclass(frozen=True)
class TunerConfig:
    buckets: tuple[int, ...] = setting((1, 2, 4, 8, 16, 32, 64, 128, 256),
                                       "batch-size bucket bounds, each bucket its own bandit")
    arms: tuple[str, ...] = setting(DEFAULT_ARMS, "the strategies it picks from, 'off' among them")
    epsilon: float = setting(0.1, "probability of an exploration draw (explore=cost or uniform)")
    window: int = setting(300, "rewards per arm and bucket the score is the median (or mean) of")
    decay: float = setting(0.99, "weight of a reward per bucket step since it was earned (1: no forgetting)")
    seed: int | None = setting(0, "seed of the exploration draws")
    prune_after: int = setting(20, "rewards an arm and the best need before the arm can be pruned")
    prune_ratio: float = setting(0.5, "an arm below this fraction of the best's median (mean) is pruned (0: never)")
    explore: str = setting("ucb", "how exploration is chosen: ucb (an upper confidence bound; epsilon unused), cost "
                                  "(epsilon draws weighed by step time) or uniform (epsilon draws)")
    ucb: float = setting(1.0, "explore=ucb: the bound's width, in spreads of log reward (the bucket's, or with "
                              "spread=arm the larger of that and the arm's own)")
    row_slope: bool = setting(True, "rank a bucket's arms as at one batch size, by a fitted slope of log reward "
                                    "on log live rows (false: raw rewards)")
    explore_run: int = setting(1, "steps an exploration draw (or an untried arm) keeps its arm; the step after a "
                                  "switch of arms is not scored (1: single exploration steps, every step scored)")
    score: str = setting("median", "what ranks an arm's window of rewards: median or mean (both decayed)")
    spread: str = setting("bucket", "explore=ucb: the spread an arm's bound is scaled by: the bucket's (pooled over its "
                                    "arms) or, with arm, the larger of that and the arm's own")

    def __post_init__(self) -> None:
        for name in ("buckets", "arms"):
            value = getattr(self, name)
            check(self, name, not isinstance(value, str) and isinstance(value, Sequence), "a tuple")
            object.__setattr__(self, name, tuple(value))
        check(self, "buckets", all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.buckets),
              "integers >= 1")
        check(self, "buckets", all(lo < hi for lo, hi in zip(self.buckets, self.buckets[1:])), "strictly increasing")
        check(self, "arms", bool(self.arms) and all(isinstance(arm, str) for arm in self.arms),
              "one or more strategy names")
        for arm in self.arms:
            try:
                canonical = Strategy.parse(arm).name
            except ConfigError as exc:
                raise FieldError("arms", f"has {arm!r}: {exc}") from None
            if canonical != arm:
                raise FieldError("arms", f"has {arm!r}: write it as {canonical!r}")
        if len(set(self.arms)) != len(self.arms):
            raise FieldError("arms", f"has duplicates: {self.arms}")
        if "off" not in self.arms:
            raise FieldError("arms", f"must include 'off' (the plain-decoding baseline), got {self.arms}")
        check_numbers(self)
        check(self, "epsilon", 0 <= self.epsilon <= 1, "in [0, 1]")
        check_int(self, "window", 1)
        check(self, "decay", 0 < self.decay <= 1, "in (0, 1]")
        if self.seed is not None:
            check_int(self, "seed")
        check_int(self, "prune_after", 1)
        check(self, "prune_ratio", 0 <= self.prune_ratio < 1, "in [0, 1)")
        check_choice(self, "explore", EXPLORE)
        check(self, "ucb", self.ucb >= 0, ">= 0")
        check(self, "row_slope", isinstance(self.row_slope, bool), "true or false")
        check_int(self, "explore_run", 1)
        check_choice(self, "score", SCORES)
        check_choice(self, "spread", SPREADS)


def _check_measure(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The value splitting the total weight in half (weights >= 0, not all 0); midway between the two middle
    values on an exact split, so equal weights give the ordinary median."""
    order = sorted(range(len(values)), key=values.__getitem__)
    cumulative = list(accumulate(weights[j] for j in order))
    half = cumulative[-1] / 2
    lower = values[order[bisect_left(cumulative, half)]]  # first value whose cumulative weight reaches half
    upper = values[order[bisect_right(cumulative, half)]]  # first value whose cumulative weight passes half
    return (lower + upper) / 2


def decayed_median(stamps: Sequence[int], values: Sequence[float], decay: float) -> float:
    """Weighted median of `values`, weight decay ** (newest stamp - stamp)."""
    if decay == 1:
        return statistics.median(values)
    newest = stamps[-1]
    return weighted_median(values, [decay ** (newest - s) for s in stamps])


def decayed_mean(stamps: Sequence[int], values: Sequence[float], decay: float) -> float:
    """Weighted mean of `values`, weight decay ** (newest stamp - stamp)."""
    if decay == 1:
        return statistics.fmean(values)
    newest = stamps[-1]
    weights = [decay ** (newest - s) for s in stamps]
    return math.fsum(w * v for w, v in zip(weights, values)) / math.fsum(weights)


def _deviations(values: Sequence[float]) -> list[float]:
    """Absolute deviations of `values` from their median; none for fewer than two values."""
    if len(values) < 2:
        return []
    middle = statistics.median(values)
    return [abs(v - middle) for v in values]


def _robust_spread(deviations: Sequence[float]) -> float:
    """1.4826 x the median absolute deviation (a normal's sigma), from the deviations; 0 with none."""
    return 1.4826 * statistics.median(deviations) if deviations else 0.0


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def row_slope(groups: Sequence[Sequence[tuple[float, float | None]]]) -> float:
    """The slope of y on x over groups of (y, x) points (an arm's (log reward, log batch size)), pooled
    within groups (each about its own means), clamped to [0, 1]; 0 when no group spans two x. Points
    with y = -inf (a reward of 0) or x = None (no batch size recorded) do not count."""
    num = den = 0.0
    for group in groups:
        points = [(x, y) for y, x in group if x is not None and y > -math.inf]
        if len(points) < 2:
            continue
        mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
        num += sum((x - mx) * (y - my) for x, y in points)
        den += sum((x - mx) ** 2 for x, _ in points)
    return min(1.0, max(0.0, num / den)) if den > 1e-12 else 0.0


class _Bucket:
    """One bandit: per-arm reward windows, counters and pruning records for one batch-size bucket."""

    def __init__(self, arms: Sequence[Strategy], window: int, low: int) -> None:
        self.low = low  # its smallest batch size, where adjusted rewards are moved to
        self.clock = 0  # rewards recorded in this bucket; the stamp of the next one
        self.slope = 0.0  # of log reward on log rows, refitted every SLOPE_EVERY rewards (row_slope)
        self.spread = 0.0  # of an arm's log rewards about its median (explore="ucb"), refitted with the slope
        self.explored = 0  # exploration choices: epsilon draws that ran, or bounds above the greedy arm's
        self.choices = {a: 0 for a in arms}
        self.windows = {a: deque(maxlen=window) for a in arms}  # arm -> deque of (stamp, reward, rows)
        self.logs = {a: deque(maxlen=window) for a in arms}  # arm -> (log reward, log rows or None), as windows
        self.pruned: dict[Strategy, dict] = {}
        self.seconds = {a: deque(maxlen=STEP_TIMES) for a in arms}  # arm -> recent step times
        # arm -> (score, median, own spread); dropped when its window changes
        self.summaries: dict[Strategy, tuple[float, float, float]] = {}
        self.weights: dict[Strategy, float] = {}  # arm -> sum of decay ** (newest stamp - stamp); as summaries
        self.run: tuple[Strategy, int] | None = None  # the arm of a run under way and its steps still to come (>= 1)
        self.last: Strategy | None = None  # the arm of the bucket's last step

    def record(self, arm: Strategy, stamp: int, reward: float, rows: int | None) -> None:
        self.windows[arm].append((stamp, reward, rows))
        self.logs[arm].append((_log(reward), math.log(rows) if rows else None))


class Tuner:
    """The bandit of the module docstring; `arms` are the config's arms as strategies, in config order."""

    def __init__(self, config: TunerConfig | None = None, log: Callable[[str], None] | None = None) -> None:
        self.config = config or TunerConfig()
        self.arms = tuple(Strategy.parse(name) for name in self.config.arms)
        self.log = log or (lambda message: None)
        self._rng = random.Random(self.config.seed)
        self._buckets = [self._bucket(i) for i in range(len(self.config.buckets) + 1)]
        self.history_seen = False  # whether a rollout has brought earlier responses (AdaptiveDecoder.start)

    def _bucket(self, i: int) -> _Bucket:
        return _Bucket(self.arms, self.config.window, self.config.buckets[i - 1] + 1 if i else 1)

    # --- the bandit --------------------------------------------------------------------------------
    def bucket_of(self, batch_size: int) -> int:
        """Index of the first bucket whose bound is >= batch_size; len(buckets) for the open bucket."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        for i, bound in enumerate(self.config.buckets):
            if batch_size <= bound:
                return i
        return len(self.config.buckets)

    def choose(self, batch_size: int, allowed: Callable[[Strategy], bool] | None = None) -> Strategy:
        """The arm to run for a step at `batch_size`, among unpruned arms that `allowed` accepts."""
        i = self.bucket_of(batch_size)
        bucket = self._buckets[i]
        candidates = [a for a in self.arms if a not in bucket.pruned and (allowed is None or allowed(a))]
        if not candidates:
            raise ValueError(f"no arm is allowed in bucket {self.label(i)}: `allowed` rejected all of "
                             f"{[a.name for a in self.arms if a not in bucket.pruned]}")
        run, bucket.run = bucket.run, None
        if run is not None and run[0] in candidates:  # a run under way goes on
            arm, left = run
        else:
            untried = [a for a in candidates if not bucket.windows[a]]
            drawn = None  # exploration waits until every arm is measured once
            if not untried and self.config.explore == "ucb":
                drawn = self._upper(bucket, candidates)
            elif not untried and self._rng.random() < self.config.epsilon / self.config.explore_run:
                drawn = self._explore(bucket, candidates)
            arm = untried[0] if untried else drawn or self._greedy(bucket, candidates)
            left = self.config.explore_run if untried or drawn else 1
        if left > 1:
            bucket.run = (arm, left - 1)
        bucket.choices[arm] += 1
        return arm

    def _explore(self, bucket: _Bucket, candidates: list[Strategy]) -> Strategy | None:
        """An exploration draw: a uniformly random candidate, which runs always under explore="uniform"
        and under "cost" with probability min(1, seconds(greedy) / seconds(drawn)) (see the module
        docstring); None when it does not run."""
        drawn = candidates[self._rng.randrange(len(candidates))]
        if self.config.explore == "cost":
            greedy = self._greedy(bucket, candidates)
            if bucket.seconds[greedy] and bucket.seconds[drawn]:
                fast, slow = statistics.median(bucket.seconds[greedy]), statistics.median(bucket.seconds[drawn])
            else:
                fast, slow = self._score(bucket, drawn), self._score(bucket, greedy)
            if self._rng.random() * slow >= fast:
                return None
        bucket.explored += 1
        return drawn

    def _upper(self, bucket: _Bucket, candidates: list[Strategy]) -> Strategy | None:
        """explore="ucb": the candidate of the highest upper bound on its log score, log score + ucb x spread x
        sqrt(ln n / n_arm), n_arm its rewards' decayed weight (their count without decay) and n the candidates'
        together; None when that is the greedy arm."""
        greedy = self._greedy(bucket, candidates)
        weights = {a: self._weight(bucket, a) for a in candidates}
        total = sum(weights.values())
        width = self.config.ucb * math.sqrt(max(0.0, math.log(total)))

        def upper(arm: Strategy) -> float:  # an arm whose weight has decayed to nothing is as if untried
            if weights[arm] <= 0:
                return math.inf
            spread = max(bucket.spread, self._summary(bucket, arm)[2]) if self.config.spread == "arm" else bucket.spread
            return _log(self._score(bucket, arm)) + width * spread / math.sqrt(weights[arm])

        best = max(candidates, key=upper)  # max keeps the first of equal bounds
        if upper(best) <= upper(greedy):
            return None
        bucket.explored += 1
        return best

    def _weight(self, bucket: _Bucket, arm: Strategy) -> float:
        """Decayed weight of the arm's rewards as of the bucket's clock: sum of decay ** (clock - 1 - stamp)."""
        window = bucket.windows[arm]
        if arm not in bucket.weights:
            newest = window[-1][0]
            bucket.weights[arm] = sum(self.config.decay ** (newest - s) for s, _, _ in window)
        return bucket.weights[arm] * self.config.decay ** (bucket.clock - 1 - window[-1][0])

    def update(self, batch_size: int, arm: Strategy, reward: float, seconds: float | None = None) -> None:
        """Record the reward (accepted tokens per second) that `arm` earned on a step at `batch_size`,
        and the step's duration when given (what explore="cost" weighs exploration draws by)."""
        self._check_arms([arm])
        _check_measure("reward", reward)
        if seconds is not None:
            _check_measure("seconds", seconds)
        i = self.bucket_of(batch_size)
        bucket = self._buckets[i]
        if seconds is not None:
            bucket.seconds[arm].append(float(seconds))
        switched = bucket.last is not None and arm != bucket.last
        bucket.last = arm
        if switched and self.config.explore_run > 1:  # started from the previous arm's place: not scored
            return
        bucket.record(arm, bucket.clock, float(reward), batch_size)
        bucket.clock += 1
        bucket.summaries.pop(arm, None)
        bucket.weights.pop(arm, None)
        if self.config.row_slope and bucket.clock % SLOPE_EVERY == 0:
            slope = row_slope(list(bucket.logs.values()))
            if slope != bucket.slope:
                bucket.slope = slope
                bucket.summaries.clear()  # every arm's adjusted rewards moved
        if self.config.explore == "ucb" and (bucket.clock < SLOPE_EVERY or bucket.clock % SLOPE_EVERY == 0):
            bucket.spread = self._spread(bucket)
        self._prune(i)

    def _spread(self, bucket: _Bucket) -> float:
        """The bucket's robust spread of log rewards within an arm: 1.4826 x the median absolute deviation of
        every (slope-adjusted) log reward from its arm's median, over arms with two rewards or more (0 with
        none). Rewards of 0 do not count."""
        deviations = []
        for arm in self.arms:
            deviations += _deviations([v for v in self._adjusted(bucket, arm) if v > -math.inf])
        return _robust_spread(deviations)

    def _adjusted(self, bucket: _Bucket, arm: Strategy) -> list[float]:
        """The arm's log rewards in window order, moved along the bucket's row slope to its smallest batch size."""
        if not bucket.slope:
            return [y for y, _ in bucket.logs[arm]]
        slope, base = bucket.slope, math.log(bucket.low)
        return [y if x is None else y - slope * (x - base) for y, x in bucket.logs[arm]]

    def best(self, batch_size: int) -> Strategy | None:
        """The greedy arm of the bucket (unpruned, with rewards), or None before any reward arrives."""
        bucket = self._buckets[self.bucket_of(batch_size)]
        tried = [a for a in self.arms if a not in bucket.pruned and bucket.windows[a]]
        return self._greedy(bucket, tried) if tried else None

    def _score(self, bucket: _Bucket, arm: Strategy) -> float:
        """Decayed median (or mean) reward of `arm` in `bucket` (what the greedy choice ranks by); +inf while it has
        none."""
        return self._summary(bucket, arm)[0] if bucket.windows[arm] else math.inf

    def _median(self, bucket: _Bucket, arm: Strategy) -> float:
        """Plain median (or mean) of the window (what pruning compares)."""
        return self._summary(bucket, arm)[1]

    def _summary(self, bucket: _Bucket, arm: Strategy) -> tuple[float, float, float]:
        """(decayed, plain) median of the arm's rewards (means under score="mean"), moved along the bucket's row
        slope to its smallest batch size, a shift in logs: medians of log rewards (exp of a log median is the
        median), means of the shifted rewards; and under spread="arm" the arm's own robust spread of log rewards
        (as the bucket's, over its rewards alone; 0 below two), else 0."""
        if arm not in bucket.summaries:
            stamps = [s for s, _, _ in bucket.windows[arm]]
            values = self._adjusted(bucket, arm)
            own = 0.0
            if self.config.spread == "arm":
                own = _robust_spread(_deviations([v for v in values if v > -math.inf]))
            if self.config.score == "mean":
                rewards = [math.exp(v) for v in values]
                bucket.summaries[arm] = (decayed_mean(stamps, rewards, self.config.decay), statistics.fmean(rewards), own)
            else:
                bucket.summaries[arm] = (math.exp(decayed_median(stamps, values, self.config.decay)),
                                         math.exp(statistics.median(values)), own)
        return bucket.summaries[arm]

    def _greedy(self, bucket: _Bucket, arms: list[Strategy]) -> Strategy:
        return max(arms, key=lambda a: self._score(bucket, a))  # max keeps the first of equal scores

    def _prune(self, i: int) -> None:
        bucket, c = self._buckets[i], self.config
        if c.prune_ratio == 0:
            return
        ripe = [a for a in self.arms if a not in bucket.pruned and len(bucket.windows[a]) >= c.prune_after]
        if len(ripe) < 2:
            return
        leader = max(ripe, key=lambda a: self._median(bucket, a))
        best_median = self._median(bucket, leader)
        for arm in ripe:
            median = self._median(bucket, arm)
            if arm.kind != "off" and median < c.prune_ratio * best_median:
                record = {"step": bucket.clock, "median": median, "best": leader.name, "best_median": best_median}
                bucket.pruned[arm] = record
                self.log(f"tuner: pruned {arm.name} from bucket {self.label(i)} at step {bucket.clock}: median "
                         f"{median:.1f} tok/s < {c.prune_ratio} x {leader.name}'s {best_median:.1f}")

    def unprune(self, arms: Sequence[Strategy]) -> None:
        """Let `arms` compete again in every bucket they were pruned from, keeping their reward windows:
        the drafter they were judged with has been replaced, and pruning is otherwise for good. Their old
        rewards fade under `decay` as fresh ones arrive, so a better drafter is recognised without paying
        to re-measure every arm in every bucket (which at large batch costs more than it tells)."""
        self._check_arms(arms)
        for bucket in self._buckets:
            for arm in arms:
                bucket.pruned.pop(arm, None)

    def forget(self, arms: Sequence[Strategy]) -> None:
        """Drop every reward, step time and pruning of `arms` in every bucket, so they are measured again as
        untried: what they draft from has changed so much that their past rewards mislead (the first rollout
        whose prompts have earlier responses, for the arms that draft from them: measured without history,
        they lost to arms that the history now beats)."""
        self._check_arms(arms)
        for bucket in self._buckets:
            for arm in arms:
                bucket.windows[arm].clear()
                bucket.logs[arm].clear()
                bucket.seconds[arm].clear()
                bucket.pruned.pop(arm, None)
                bucket.summaries.pop(arm, None)
                bucket.weights.pop(arm, None)
                if bucket.run is not None and bucket.run[0] == arm:
                    bucket.run = None

    def _check_arms(self, arms: Sequence[Strategy]) -> None:
        for arm in arms:
            if arm not in self._buckets[0].choices:
                raise ValueError(f"unknown arm {arm!r}; this tuner's arms are {self.config.arms}")

    # --- reporting and state -----------------------------------------------------------------------
    def label(self, i: int) -> str:
        """Human-readable batch sizes of bucket i: "1", "3-4", ">32"."""
        bounds = self.config.buckets
        if i == len(bounds):
            return f">{bounds[-1]}" if bounds else ">=1"
        low = bounds[i - 1] + 1 if i else 1
        return str(low) if low == bounds[i] else f"{low}-{bounds[i]}"

    def stats(self) -> dict:
        """Per bucket (list index = bucket index): choice counts, explorations, window sizes, plain and
        decayed medians (means under score="mean"; the latter is what the greedy choice ranks; both as at the
        bucket's smallest batch size, moved along its row slope), the slope, the bucket's spread and, under
        spread="arm", each arm's own, the greedy arm, and the pruned arms with why they were pruned."""
        out = []
        for i, bucket in enumerate(self._buckets):
            tried = [a for a in self.arms if bucket.windows[a]]
            best = self._greedy(bucket, [a for a in tried if a not in bucket.pruned]) if tried else None
            out.append({
                "bucket": self.label(i),
                "steps": bucket.clock,
                "choices": {a.name: n for a, n in bucket.choices.items()},
                "explored": bucket.explored,
                "samples": {a.name: len(bucket.windows[a]) for a in tried},
                "median": {a.name: self._median(bucket, a) for a in tried},
                "score": {a.name: self._score(bucket, a) for a in tried},
                "row_slope": bucket.slope,
                "spread": bucket.spread,
                **({"arm_spread": {a.name: self._summary(bucket, a)[2] for a in tried}}
                   if self.config.spread == "arm" else {}),
                "best": best.name if best is not None else None,
                "pruned": {a.name: dict(r) for a, r in bucket.pruned.items()},
            })
        return {"buckets": out}

    def state_dict(self) -> dict:
        """Everything needed to continue identically, as plain JSON types."""
        version, internal, gauss = self._rng.getstate()
        return {
            "version": STATE_VERSION,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self.config).items()},
            "rng": [version, list(internal), gauss],
            "history_seen": self.history_seen,
            "buckets": [{
                "clock": b.clock,
                "slope": b.slope,
                "spread": b.spread,
                "explored": b.explored,
                "choices": {a.name: n for a, n in b.choices.items()},
                "windows": {a.name: [list(entry) for entry in w] for a, w in b.windows.items() if w},
                "seconds": {a.name: list(t) for a, t in b.seconds.items() if t},
                "pruned": {a.name: dict(r) for a, r in b.pruned.items()},
                "run": [b.run[0].name, b.run[1]] if b.run is not None else None,
                "last": b.last.name if b.last is not None else None,
            } for b in self._buckets],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; the saved config must equal this tuner's config."""
        saved = self._config_of(state)
        if saved != self.config:
            diff = [f.name for f in dataclasses.fields(TunerConfig)
                    if getattr(saved, f.name) != getattr(self.config, f.name)]
            raise ConfigError(f"tuner state was saved with a different config (fields {diff}); "
                              "use Tuner.from_state_dict")
        if len(state["buckets"]) != len(self._buckets):
            raise ConfigError(f"tuner state has {len(state['buckets'])} buckets, expected {len(self._buckets)}")
        by_name = {a.name: a for a in self.arms}
        buckets = []
        for i, saved_bucket in enumerate(state["buckets"]):
            bucket = self._bucket(i)
            bucket.clock, bucket.explored = int(saved_bucket["clock"]), int(saved_bucket["explored"])
            bucket.slope = float(saved_bucket.get("slope", 0.0))
            bucket.spread = float(saved_bucket.get("spread", 0.0))
            bucket.choices.update({by_name[a]: int(n) for a, n in saved_bucket["choices"].items()})
            for name, window in saved_bucket["windows"].items():
                for s, r, *rows in window:  # versions 1-2: (stamp, reward), no batch size
                    bucket.record(by_name[name], int(s), float(r), int(rows[0]) if rows and rows[0] is not None else None)
            bucket.pruned = {by_name[a]: dict(r) for a, r in saved_bucket["pruned"].items()}
            for name, times in saved_bucket.get("seconds", {}).items():
                bucket.seconds[by_name[name]].extend(float(t) for t in times)
            if saved_bucket.get("run") is not None:  # versions 1-3: none
                name, left = saved_bucket["run"]
                bucket.run = (by_name[name], int(left))
            if saved_bucket.get("last") is not None:
                bucket.last = by_name[saved_bucket["last"]]
            buckets.append(bucket)
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._buckets = buckets
        self.history_seen = bool(state.get("history_seen", False))  # absent from older states: false

    @classmethod
    def from_state_dict(cls, state: dict, log: Callable[[str], None] | None = None) -> "Tuner":
        """A tuner with the saved config and state."""
        tuner = cls(cls._config_of(state), log=log)
        tuner.load_state_dict(state)
        return tuner

    @staticmethod
    def _config_of(state: dict) -> TunerConfig:
        if state.get("version") not in (1, 2, 3, STATE_VERSION):
            raise ConfigError(f"tuner state version {state.get('version')!r} is not {STATE_VERSION} (or 1-3)")
        return from_dict(TunerConfig, state["config"], source="tuner state")
