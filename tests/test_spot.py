"""The adaptive drafter's parts without Ray: buffer, schedule, coordinator, spot trainer, checkpoints,
shares, and hot-swapping a drafter into a running engine."""

import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tlt.errors import CheckpointError, ConfigError, TrainingError
from tlt.rollout import EngineConfig, RolloutEngine, SamplingParams
from tlt.speculative.data import DraftRecord, collect
from tlt.speculative.drafter import Drafter
from tlt.spot.buffer import Entry, OnlineBuffer, favour_long, keep_recent, sampled_batches
from tlt.spot.coordinator import Coordinator, WorkerState
from tlt.spot.config import SpotConfig
from tlt.spot.checkpoint import (DrafterCheckpointer, _snapshot, latest_drafter_checkpoint, load_checkpoint,
                                 write_checkpoint)
from tlt.spot.schedule import ANY, Schedule
from tlt.spot.trainer import SpotTrainer
from tlt.rollout.stats import RolloutStats
from tlt.spot.rollout import drafter_acceptance, drafter_arms
from tlt.spot.shares import LengthPredictor, assign
from tlt.spot.workers import ShareStats


def record(n: int, H: int = 4, fill: float = 0.0) -> DraftRecord:
    return DraftRecord(torch.arange(n), torch.full((n, H), fill), prompt_len=3)


def small(**fields) -> SpotConfig:
    base = dict(train="every", min_pairs=1, lr=3e-3, warmup_steps=0, batch_tokens=128, rows=2, window=32, unroll=1,
                holdout=0.0)
    base.update(fields)
    return SpotConfig(**base)


@pytest.fixture
def target(tiny_model):
    return tiny_model(seed=3)


@pytest.fixture
def records(target):
    return collect(target, None, [[1, 5, 7], [1, 9], [1, 4, 4, 8, 3]], samples_per_prompt=4, temperature=1.0,
                   max_tokens=40, seed=0)


# --- buffer ----------------------------------------------------------------------------------------
def test_buffer_keeps_the_last_versions_and_its_byte_bound():
    buffer = OnlineBuffer(max_bytes=10**9, evict=keep_recent(2))
    for version in range(4):
        buffer.add([record(5), record(1)], version)  # a 1-token response has no pair and is skipped
    assert buffer.versions == [2, 3] and len(buffer) == 2
    one = Entry(record(5), 0, 0).nbytes
    bounded = OnlineBuffer(max_bytes=2 * one, evict=keep_recent(10))
    bounded.add([record(5, fill=1.0), record(5, fill=2.0)], 0)
    bounded.add([record(5, fill=3.0)], 1)
    assert bounded.nbytes <= 2 * one
    assert [float(e.record.features[0, 0]) for e in bounded.entries] == [2.0, 3.0]  # oldest dropped first
    assert bounded.stats()["evicted"] == 1
    with pytest.raises(ConfigError, match="versions"):
        keep_recent(0)
    with pytest.raises(ConfigError, match="kept nothing"):
        OnlineBuffer(evict=lambda entries: []).add([record(4)], 0)


def test_sampling_favours_long_responses_in_proportion():
    entries = [Entry(record(11), 0, 0), Entry(record(41), 0, 1)]  # 10 and 40 pairs
    weights = favour_long(1.0)(entries)
    assert weights == [10.0, 40.0]
    batches = sampled_batches(entries, weights, rows=4, row_tokens=64, window=64, seed=0)
    lengths = []
    for _ in range(50):
        batch = next(batches)
        starts = (batch.positions == 0) & batch.mask
        for row in range(batch.tokens.shape[0]):
            idx = starts[row].nonzero().flatten().tolist() + [int(batch.mask[row].sum())]
            lengths += [b - a for a, b in zip(idx, idx[1:])]
    share_long = lengths.count(40) / len(lengths)
    assert abs(share_long - 0.8) < 0.06, share_long  # drawn 4x as often as the short one
    assert set(lengths) == {10, 40}  # whole windows, never cut


def test_windows_are_the_last_pairs_of_a_response():
    entries = [Entry(record(100), 0, 0)]
    batch = next(sampled_batches(entries, [1.0], rows=1, row_tokens=32, window=16, seed=0))
    assert batch.tokens[0, :16].tolist() == list(range(83, 99))  # pairs 83..98 of 99


# --- schedule --------------------------------------------------------------------------------------
ARM = "tree-d4-k2-v8"


def one_arm(acceptance: float | None) -> dict:
    """A rollout of one learned arm (None: no drafter step ran), as `drafter_arms` reports it."""
    return {} if acceptance is None else {ARM: (acceptance, 100)}


def test_acceptance_schedule_ignores_single_noisy_rollouts():
    """Per-rollout acceptance swings by +-15% on the default workload; judged one rollout at a time
    against the best ever, that noise alone kept a converged drafter training. A lone high or low
    rollout moves no decision, and a flat but noisy series trains on a minority of steps."""
    acc = Schedule(small(train="acceptance", train_fraction=0.9))
    for a in (3.0, 3.1, 3.0, 3.05, 3.0):
        acc.observe(one_arm(a))
    assert not acc.due(0, 10)
    rng = random.Random(0)
    decisions = []
    for step in range(200):
        acc.observe(one_arm(3.0 * math.exp(rng.gauss(0.0, 0.08))))  # a flat level with rollout-to-rollout noise
        decisions.append(acc.due(step, 10))
    # measured: 43 of 200 with the level and the fading best; 174 judging each rollout against the best ever
    assert sum(decisions) <= 60
    for a in (2.4, 2.4):
        acc.observe(one_arm(a))
    assert acc.due(200, 10)  # a drop that lasts is seen within two rollouts


def test_acceptance_schedule_judges_each_arm_against_its_own_best():
    """An adaptive rollout mixes arms of very different acceptance (2.2 and 6.5 tokens a step) in a mix
    that follows the step's response lengths: judged as one figure, a converged drafter looks behind or
    improving at most steps; per arm, weighted by row-steps, it trains on few, and a drop of every arm
    is still seen."""
    rng = random.Random(1)
    per_arm, pooled, decisions, pooled_decisions = Schedule(small(train="acceptance")), Schedule(
        small(train="acceptance")), [], []
    for step in range(200):
        wide = rng.randint(0, 400)  # row-steps of the deep tree this rollout
        arms = {"tree-d2-k1-v2": (2.2 * math.exp(rng.gauss(0.0, 0.04)), 400 - wide + 1),
                "tree-d8-k2-v12": (6.5 * math.exp(rng.gauss(0.0, 0.04)), wide + 1)}
        per_arm.observe(arms)
        pooled.observe(one_arm(sum(a * n for a, n in arms.values()) / sum(n for _, n in arms.values())))
        decisions.append(per_arm.due(step, 10))
        pooled_decisions.append(pooled.due(step, 10))
    # measured: 11 of 200 per arm, 136 pooled
    assert sum(decisions) <= 30 < 100 <= sum(pooled_decisions)
    for _ in range(2):
        per_arm.observe({"tree-d2-k1-v2": (1.8, 200), "tree-d8-k2-v12": (5.2, 200)})
    assert per_arm.due(200, 10)  # both arms 20% down
    assert per_arm.behind < 0.9
    before = per_arm.state_dict()
    for nothing in ({}, {"tree-d8-k2-v12": (None, 0)}, {"tree-d8-k2-v12": (0.0, 5)}):
        per_arm.observe(nothing)  # no learned arm ran, or it measured nothing
    assert per_arm.state_dict() == before


def test_an_arm_that_returns_is_judged_on_its_last_three_runs():
    """An arm the tuner left for a while keeps its last 3 measurements: returning 40% down it reads behind
    after two of its rollouts, as an arm that runs every step does (a single low rollout moves nothing).
    The state round-trips; a saved state that weighs an arm without a level is refused by name."""
    acc = Schedule(small(train="acceptance"))
    for _ in range(3):
        acc.observe({"tree-d8-k2-v12": (6.0, 100), "tree-d4-k2-v8": (4.0, 100)})
    assert not acc.due(0, 10)
    for _ in range(4):
        acc.observe({"tree-d4-k2-v8": (4.0, 100)})
    acc.observe({"tree-d8-k2-v12": (3.6, 100), "tree-d4-k2-v8": (4.0, 10)})
    assert acc.level("tree-d8-k2-v12") == 6.0 and not acc.due(1, 10)
    acc.observe({"tree-d8-k2-v12": (3.6, 100), "tree-d4-k2-v8": (4.0, 10)})
    assert acc.level("tree-d8-k2-v12") == 3.6 and acc.due(2, 10)
    restored = Schedule(small(train="acceptance"))
    restored.load_state_dict(acc.state_dict())
    assert restored.state_dict() == acc.state_dict() and restored.due(3, 10)
    with pytest.raises(CheckpointError, match="drafter schedule state.*tree-d2"):
        restored.load_state_dict({**acc.state_dict(), "weights": {"tree-d2-k1-v2": 5}})


def test_schedule_modes():
    every = Schedule(small(train="every", min_pairs=100))
    assert not every.due(0, 99) and every.due(0, 100)
    n = Schedule(small(train="every-N", train_every=3))
    assert [n.due(s, 10) for s in range(6)] == [True, False, False, True, False, False]
    acc = Schedule(small(train="acceptance", train_fraction=0.9))
    assert acc.due(0, 10)  # nothing measured yet
    acc.observe(one_arm(3.0))
    assert acc.due(1, 10)  # a first best: still learning
    acc.observe(one_arm(3.05))  # level: median(3.0, 3.05)
    assert not acc.due(2, 10)  # within 2% of the best: converged
    acc.observe(one_arm(2.6))  # one low rollout: the level (median of the last 3) is still 3.0
    assert not acc.due(3, 10)
    acc.observe(one_arm(2.6))  # a sustained drop: level 2.6 < 0.9 x 3.025, the policy moved away
    assert acc.due(4, 10)
    acc.observe(one_arm(None))  # no drafter step ran: keeps the last measurement
    assert acc.due(5, 10)
    acc.observe(one_arm(3.5))
    acc.observe(one_arm(3.5))  # the phases helped a lot (level 3.5): keep training
    assert acc.due(6, 10)
    restored = Schedule(small(train="acceptance"))
    restored.load_state_dict(acc.state_dict())
    assert restored.due(7, 10) and restored.best == {ARM: 3.5} and restored.recent == acc.recent
    for old_state, level in (({"best": 3.5, "last": 3.5, "improving": False}, 3.5),  # before levels were medians
                             ({"best": 3.5, "recent": [3.4, 3.5], "improving": False}, 3.45)):  # before per arm
        restored.load_state_dict(old_state)
        assert restored.level(ANY) == level and not restored.due(8, 10)
    restored.observe({"tree-d4-k2-v8": (3.5, 10)})  # the first per-arm rollout replaces the one old level
    assert set(restored.best) == {"tree-d4-k2-v8"} and restored.due(9, 10)  # a first measurement
    assert not Schedule(small(train="off")).due(0, 10**6)
    with pytest.raises(ConfigError, match="field 'train' must be one of"):
        SpotConfig(train="sometimes")
    with pytest.raises(ConfigError, match="batch_tokens"):
        SpotConfig(batch_tokens=100, rows=4, window=256)
    with pytest.raises(ConfigError, match=r"field 'holdout' must be in \[0, 1\), got 1.0"):
        SpotConfig(holdout=1.0)


# --- coordinator -----------------------------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_coordinator_lifecycle_and_timeline():
    clock = FakeClock()
    c = Coordinator(3, clock)
    assert c.states == [WorkerState.IDLE] * 3
    c.start_rollout()
    clock.t = 1.0
    assert c.released(1, training_due=True)  # first released while others generate: trains
    assert c.states[1] is WorkerState.TRAINING and c.trainer == 1
    clock.t = 2.0
    assert not c.released(0, training_due=True)  # one trainer at a time
    assert c.states[0] is WorkerState.DONE
    clock.t = 5.0
    assert not c.released(2, training_due=True)  # the last one: nobody is generating any more
    assert not c.rollout_active
    c.trainer_stopped()
    assert c.states == [WorkerState.DONE] * 3
    s = c.summary()
    assert s.generating_s == [2.0, 1.0, 5.0]
    assert s.training_s == [0.0, 4.0, 0.0]
    assert s.idle_s == [3.0, 0.0, 0.0]
    c.start_rollout()  # the next rollout starts from DONE
    assert c.states == [WorkerState.GENERATING] * 3


def test_coordinator_refuses_impossible_events():
    c = Coordinator(2, FakeClock())
    with pytest.raises(TrainingError, match="idle to released"):
        c.released(0, training_due=False)
    c.start_rollout()
    with pytest.raises(TrainingError, match="already running"):
        c.start_rollout()
    assert not c.released(0, training_due=False)
    with pytest.raises(TrainingError, match="done to released"):
        c.released(0, training_due=False)
    with pytest.raises(TrainingError, match="no worker is training"):
        c.trainer_stopped()
    c.restarted(1)
    assert c.restarts == [0, 1] and c.states[1] is WorkerState.GENERATING
    assert not c.released(1, training_due=True)  # last worker: no idle time left to train in


# --- spot trainer ----------------------------------------------------------------------------------
def batches_of(records, c: SpotConfig, seed=0):
    entries = [Entry(r, 0, j) for j, r in enumerate(records)]
    return sampled_batches(entries, favour_long()(entries), c.rows, c.row_tokens, c.window, seed)


def test_spot_trainer_learns_and_round_trips(target, records):
    from tlt.speculative.train import acceptance_top1

    drafter = Drafter.from_target(target, seed=0)
    before = acceptance_top1(drafter, records)
    c = small(max_steps=60)
    trainer = SpotTrainer(drafter, c)
    result = trainer.train(batches_of(records, c), lambda: False)
    assert result.steps == 60 and result.stopped == "max_steps" and trainer.version == 1
    after = acceptance_top1(drafter, records)
    assert after > before + 0.2, (before, after)
    other = SpotTrainer(Drafter.from_target(target, seed=1), c)
    other.load_state_dict(trainer.state_dict())
    assert other.steps == 60 and other.version == 1
    assert all(torch.equal(a, b) for a, b in zip(other.drafter.state_dict().values(), drafter.state_dict().values()))
    # the target is never touched by drafter training
    assert not any(p.grad is not None for p in target.parameters())


def test_preemption_is_honoured_within_one_optimizer_step(target, records):
    """A stop request from another thread ends training after at most the optimizer step in flight."""
    c = small(batch_tokens=512, rows=4, window=64)
    trainer = SpotTrainer(Drafter.from_target(target, seed=0), c)
    step_times, stop, requested = [], threading.Event(), {}
    batches = batches_of(records, c)

    def timed():
        while True:
            start = time.perf_counter()
            batch = next(batches)
            yield batch
            step_times.append(time.perf_counter() - start)

    def request_stop():
        time.sleep(0.5)
        requested["t"] = time.perf_counter()
        stop.set()

    threading.Thread(target=request_stop).start()
    result = trainer.train(timed(), stop.is_set, lambda: requested.get("t"))
    assert result.stopped == "stop" and result.steps >= 1
    assert result.stop_latency_s is not None
    assert result.stop_latency_s <= max(step_times) * 1.5 + 0.05, (result.stop_latency_s, max(step_times))
    # a phase asked to stop before it starts takes no step and publishes no version
    idle = trainer.train(batches, lambda: True)
    assert idle.steps == 0 and trainer.version == 1


@pytest.mark.parametrize("unroll", [1, 3])
def test_a_stop_inside_a_step_drops_that_step_and_keeps_the_last_whole_one(target, records, unroll):
    """The stop is checked between training-time-test rounds and as gradients arrive: a stop seen there
    ends the phase with the weights and optimizer state of the steps completed before it, bit for bit."""
    c = small(unroll=unroll)
    reference = SpotTrainer(Drafter.from_target(target, seed=0), small(unroll=unroll, max_steps=1))
    reference.train(batches_of(records, c), lambda: False)

    def counting(limit):
        calls = {"n": 0}

        def should_stop():
            calls["n"] += 1
            return calls["n"] > limit
        return should_stop, calls

    probe, calls = counting(10**9)
    SpotTrainer(Drafter.from_target(target, seed=0), small(unroll=unroll, max_steps=1)).train(batches_of(records, c), probe)
    checks_per_step = calls["n"] - 1  # the loop checks once before the step
    assert checks_per_step >= 2 * unroll  # parameters' gradients, plus the rounds after the first
    for limit, whole_steps in ((2, 0), (1 + checks_per_step + 2, 1)):  # inside step 1; inside step 2
        trainer = SpotTrainer(Drafter.from_target(target, seed=0), c)
        should_stop, _ = counting(limit)
        result = trainer.train(batches_of(records, c), should_stop)
        assert result.stopped == "stop" and result.steps == whole_steps == trainer.steps
        assert all(p.grad is None for p in trainer.drafter.parameters())
        want = reference.drafter if whole_steps else Drafter.from_target(target, seed=0)
        assert all(torch.equal(a, b) for a, b in zip(trainer.drafter.state_dict().values(), want.state_dict().values()))
        assert trainer.version == whole_steps and len(trainer.optimizer.state) == (len(reference.optimizer.state) if whole_steps else 0)
        # the hooks are gone with the phase: a later backward through the drafter is not interrupted
        assert not trainer.drafter.fc.weight._backward_hooks


def test_a_stop_mid_step_is_honoured_within_part_of_the_step(target, records):
    """An unrolled step over a large batch takes long; a stop requested in the middle of one ends the
    phase well before that step would have finished."""
    c = small(batch_tokens=2048, rows=4, window=64, unroll=3)
    trainer = SpotTrainer(Drafter.from_target(target, seed=0), c)
    timing = SpotTrainer(Drafter.from_target(target, seed=0), small(batch_tokens=2048, rows=4, window=64, unroll=3, max_steps=3))
    start = time.perf_counter()
    timing.train(batches_of(records, c), lambda: False)
    step_s = (time.perf_counter() - start) / 3
    stop, requested = threading.Event(), {}

    def request_stop():
        time.sleep(step_s * 0.1)  # early in the second step
        requested["t"] = time.perf_counter()
        stop.set()

    def after_step(steps: int) -> None:
        if steps == 1:
            threading.Thread(target=request_stop).start()

    result = trainer.train(batches_of(records, c), stop.is_set, lambda: requested.get("t"), after_step)
    assert result.stopped == "stop" and result.steps == 1
    assert result.stop_latency_s is not None and result.stop_latency_s < 0.5 * step_s, (result.stop_latency_s, step_s)


# --- checkpoints -----------------------------------------------------------------------------------
def test_async_checkpoint_round_trip(tmp_path, target, records):
    c = small(max_steps=3)
    trainer = SpotTrainer(Drafter.from_target(target, seed=0), c)
    trainer.train(batches_of(records, c), lambda: False)
    writer = DrafterCheckpointer(tmp_path / "ck", keep=2)
    writer.save_async(trainer.state_dict(), trainer.drafter.config, {"rl_step": 7})
    saved = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    trainer.train(batches_of(records, c, seed=1), lambda: False)  # training goes on while it writes
    writer.wait()
    folder = latest_drafter_checkpoint(tmp_path / "ck")
    restored = SpotTrainer(Drafter.from_target(target, seed=5), c)
    meta = load_checkpoint(folder, restored)
    assert meta["rl_step"] == 7 and restored.steps == 3 and restored.version == 1
    for k, v in restored.drafter.state_dict().items():
        assert torch.equal(v, saved[k]), k  # the snapshot, not the weights trained after it
    assert Drafter.load(folder, target) is not None  # also a loadable drafter folder
    for _ in range(3):
        trainer.train(batches_of(records, c), lambda: False)
        writer.save(trainer.state_dict(), trainer.drafter.config)
    assert len(list((tmp_path / "ck").glob("drafter_*"))) == 2  # keep=2


def test_a_new_run_in_an_old_runs_folder_keeps_what_latest_names(tmp_path, target):
    """Versions start again at 1 in a new run; the old run's higher-numbered checkpoints must not push
    out the one latest.json has just been pointed at."""
    trainer = SpotTrainer(Drafter.from_target(target, seed=0), small())
    root = tmp_path / "ck"
    for version in (22, 23, 1):  # an old run's last two, then the new run's first
        trainer.version = version
        write_checkpoint(root, _snapshot(trainer.state_dict()), trainer.drafter.config, {}, keep=2)
        assert latest_drafter_checkpoint(root).name == f"drafter_{version:08d}"
    assert sorted(p.name for p in root.glob("drafter_*")) == ["drafter_00000001", "drafter_00000023"]


KILL_SCRIPT = textwrap.dedent("""
    import sys, torch
    from tlt.model import ModelConfig, Transformer
    from tlt.speculative.drafter import Drafter
    from tlt.spot.config import SpotConfig
    from tlt.spot.checkpoint import DrafterCheckpointer
    from tlt.spot.trainer import SpotTrainer
    torch.manual_seed(0)
    target = Transformer(ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=61, hidden_size=256,
        intermediate_size=512, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=256, qk_norm=True))
    trainer = SpotTrainer(Drafter.from_target(target, seed=0), SpotConfig(batch_tokens=1024, rows=4, window=256))
    writer = DrafterCheckpointer(sys.argv[1], keep=2)
    version = 0
    print("ready", flush=True)
    while True:
        version += 1
        with torch.no_grad():
            for p in trainer.drafter.parameters():
                p.fill_(float(version))
        trainer.version, trainer.steps = version, version
        writer.save_async(trainer.state_dict(), trainer.drafter.config)
""")


def test_a_kill_during_save_never_leaves_a_torn_checkpoint(tmp_path, target):
    """SIGKILL a process that checkpoints back to back, at several moments: the newest complete checkpoint
    always loads, and its weights all carry its own version (nothing half-written or mixed)."""
    script = tmp_path / "saver.py"
    script.write_text(KILL_SCRIPT)
    root = tmp_path / "ck"
    for delay in (0.3, 0.55, 0.8, 1.1):
        proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        folder = latest_drafter_checkpoint(root)
        if folder is None:
            continue
        from tlt.spot.checkpoint import read_state

        state = read_state(folder)
        values = {float(v.flatten()[0]) for v in state["drafter"].values()}
        assert values == {float(state["version"])}, (folder, values)
        assert all(torch.all(v == state["version"]) for v in state["drafter"].values())
    assert latest_drafter_checkpoint(root) is not None


def test_unreadable_pointer_is_named(tmp_path):
    (tmp_path / "latest.json").write_text("{")
    with pytest.raises(CheckpointError, match="latest.json"):
        latest_drafter_checkpoint(tmp_path)


# --- shares and stats ------------------------------------------------------------------------------
def test_assign_balances_by_predicted_cost():
    costs = [10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 8]
    shares = assign(costs, 2)
    loads = [sum(costs[i] for i in s) for s in shares]
    assert sorted(i for s in shares for i in s) == list(range(len(costs)))  # each group exactly once
    assert abs(loads[0] - loads[1]) <= 1
    assert assign([5, 5], 3)[2] == []


def test_length_predictor():
    p = LengthPredictor()
    assert p.predict([1, 2]) == 1.0  # nothing seen: uniform
    for n in range(2, 12):
        p.observe(list(range(n)), [10 * n, 10 * n])
    assert p.predict(list(range(5))) == 50.0  # seen before: its own mean
    assert abs(p.predict(list(range(20))) - 200.0) < 1e-6  # unseen: the line on prompt length


def test_merge_share_stats_and_drafter_acceptance():
    a = ShareStats(RolloutStats(2, 5, 9, [0.5, 0.5], [2, 1], ["off", "chain-d4"], [2, 4], 1.0), drafter_swaps=1)
    b = ShareStats(RolloutStats(1, 3, 3, [2.0], [1], ["ngram-d4"], [3], 2.0), drafter_swaps=2)
    m = ShareStats.merge([a, b])
    assert m.rollout.steps == 3 and m.rollout.decode_tokens == 12 and m.rollout.wall_time == 2.0
    assert m.drafter_swaps == 3
    assert m.rollout.acceptance_length() == (4 + 3) / 2
    assert m.rollout.rows_by_strategy() == {"chain-d4": 1, "ngram-d4": 1}
    assert m.rollout.acceptance_by_strategy() == {"chain-d4": 4.0, "ngram-d4": 3.0}
    assert drafter_acceptance(m.rollout) == 4.0  # n-gram steps do not count for the learned drafter
    assert drafter_acceptance(b.rollout) is None
    # what the schedule judges: the learned arms' acceptance and row-steps, n-gram and off left out
    assert drafter_arms(m.rollout) == {"chain-d4": (4.0, 1)} and drafter_arms(b.rollout) == {}


# --- hot swap --------------------------------------------------------------------------------------
def test_drafter_swapped_mid_rollout_changes_no_output(target):
    """Lossless whatever the drafter: greedy outputs with a drafter swapped in between engine steps equal
    plain decoding exactly; the tuner un-prunes the drafter arms at the swap."""
    prompts = [[1, 5, 7], [1, 9, 3, 3], [1, 4]]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = RolloutEngine(target, config=EngineConfig(progress=False)).generate(prompts, params)
    engine = RolloutEngine(target, config=EngineConfig(progress=False, speculative="adaptive",
                                                       drafter=Drafter.from_target(target, seed=0)))
    other = Drafter.from_target(target, seed=9).trainable_state()
    swaps = []

    drafter_arms = [a for a in engine.tuner.arms if a.uses_drafter]

    def swap(e):
        if e._stats.steps == 8:
            bucket = e.tuner._buckets[e.tuner.bucket_of(len(e.batch))]
            bucket.pruned[drafter_arms[0]] = {"step": 0}  # as if the old drafter had lost there
            e.load_drafter(other, 1)
            swaps.append(sum(a in b.pruned for b in e.tuner._buckets for a in drafter_arms))

    engine.step_callback = swap
    out = engine.generate(prompts, params)
    assert [c.token_ids for o in out for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
    assert swaps == [0]  # pruned under the old drafter, free to compete under the new one
    assert engine.drafter_version == 1
    assert torch.equal(engine.drafter.fc.weight, other["fc.weight"])
    with pytest.raises(CheckpointError):
        engine.load_drafter({"fc.weight": other["fc.weight"]}, 2)


def test_export_finds_the_newest_online_drafter_of_a_run(tmp_path, target, records):
    from tlt.speculative.export import find_drafter

    c = small(max_steps=2)
    trainer = SpotTrainer(Drafter.from_target(target, seed=0), c)
    writer = DrafterCheckpointer(tmp_path / "run" / "drafter")
    for _ in range(3):
        trainer.train(batches_of(records, c), lambda: False)
        writer.save(trainer.state_dict(), trainer.drafter.config)
    assert find_drafter(tmp_path / "run").name == "drafter_00000003"


def test_a_stop_that_overtakes_its_phase_still_stops_it_and_no_later_one(tmp_path, target, records):
    from tlt.spot.workers import RolloutWorker, WorkerSpec

    target.save_pretrained(tmp_path / "model")
    worker = RolloutWorker(WorkerSpec(str(tmp_path / "model"), EngineConfig(speculative="adaptive", drafter="random")))
    c = small(max_steps=2)
    weights = favour_long()([Entry(r, 0, j) for j, r in enumerate(records)])
    worker.stop_training(1)  # arrives before phase 1 has begun
    _, report = worker.train(1, None, records, weights, c, seed=0)
    assert report.steps == 0 and report.stopped == "stop"
    state, report = worker.train(2, None, records, weights, c, seed=0)  # the old stop does not reach phase 2
    assert report.steps == 2 and report.stopped == "max_steps" and state["version"] == 1
    assert torch.equal(worker.drafter_tensor("fc.weight"), state["drafter"]["fc.weight"])


def test_learning_rate_warms_up_over_the_trainers_life(target):
    trainer = SpotTrainer(Drafter.from_target(target, seed=0), small(lr=1e-3, warmup_steps=4))
    rates = []
    for steps in range(6):
        trainer.steps = steps
        rates.append(trainer.learning_rate())
    assert rates == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert SpotTrainer(trainer.drafter, small(lr=1e-3, warmup_steps=0)).learning_rate() == 1e-3


def test_a_low_precision_drafter_trains_as_a_float32_twin(target, records):
    """An engine in bf16 keeps its drafter in bf16; the phase trains a float32 twin (over float32 copies
    of the embedding and LM head) and writes its weights back, cast, before every hook and at the end.
    It learns as the float32 drafter does."""
    import copy

    from tlt.speculative.train import acceptance_top1
    from tlt.spot.trainer import run_phase

    low = copy.deepcopy(target).to(torch.bfloat16)
    drafter = Drafter.from_target(low, seed=0).eval()
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    seen = []
    state, report = run_phase(drafter, None, records, [1.0] * len(records), small(max_steps=40), seed=0,
                              after_step=lambda s: seen.append({k: v.clone() for k, v in drafter.state_dict().items()}))
    assert report.steps == 40 and len(seen) == 40
    assert all(v.dtype == torch.float32 for v in state["drafter"].values())
    assert all(v.dtype == torch.bfloat16 for v in drafter.state_dict().values())
    assert any(not torch.equal(start[k], v) for k, v in seen[0].items())  # published before the first hook
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, state["drafter"][name].to(torch.bfloat16)) and torch.equal(tensor, seen[-1][name])
    twin = Drafter.from_target(target, seed=0)
    twin.load_state_dict(state["drafter"])
    full = Drafter.from_target(target, seed=0)
    untrained = acceptance_top1(full, records)
    run_phase(full, None, records, [1.0] * len(records), small(max_steps=40), seed=0)
    assert acceptance_top1(twin, records) > untrained + 0.1
    assert acceptance_top1(twin, records) >= acceptance_top1(full, records) - 0.05
    assert not any(p.grad is not None for p in low.parameters())


# --- held-out check of a phase ---------------------------------------------------------------------
def test_the_held_out_responses_are_a_seeded_share_packed_whole_and_never_trained_on(target, records, monkeypatch):
    from tlt.spot import trainer as T

    c = small(holdout=0.5, batch_tokens=256, rows=2, window=32)  # held out: at most one row of 128 pairs
    weights = [0.0] + [1.0] * (len(records) - 1)  # response 0 is never drawn into training
    held, batch = T.holdout(records, weights, c, seed=5)
    assert held == T.holdout(records, weights, c, seed=5)[0] and held != T.holdout(records, weights, c, seed=6)[0]
    assert 1 <= len(held) <= round(0.5 * (len(records) - 1)) and 0 not in held
    pairs = [min(records[j].tokens.shape[0] - 1, c.window) for j in held]
    assert batch.mask.sum() == sum(pairs) <= c.row_tokens
    assert T.holdout(records, weights, small(holdout=0.0), seed=5) == ([], None)
    assert len(T.holdout(records[:2], [1.0, 1.0], small(holdout=0.125), seed=5)[0]) == 1  # at least one, never all
    assert T.holdout([records[0], record(1)], [1.0, 1.0], small(holdout=0.5), seed=5) == ([], None)  # one usable
    from tlt.spot import buffer

    trained = []
    real = buffer.sampled_batches

    def spy(entries, w, *args):
        trained.extend(e.record for e in entries)
        return real(entries, w, *args)

    monkeypatch.setattr(buffer, "sampled_batches", spy)
    _, report = T.run_phase(Drafter.from_target(target, seed=0), None, records, weights,
                            small(holdout=0.5, batch_tokens=256, rows=2, window=32, max_steps=1), seed=5)
    assert report.heldout_start is not None
    assert not any(records[j] is r for j in held for r in trained) and len(trained) == len(records) - len(held)


def test_a_phase_publishes_its_best_held_out_step(target, records):
    """With a held-out share, the phase ends on the weights that scored best on it, and says so."""
    from tlt.spot.trainer import holdout, run_phase

    c = small(holdout=0.25, max_steps=12)
    drafter = Drafter.from_target(target, seed=0)
    weights = [1.0] * len(records)
    state, report = run_phase(drafter, None, records, weights, c, seed=1)
    assert report.steps == 12 and 1 <= report.kept <= 12 and state["version"] == 1
    assert report.heldout_kept > report.heldout_start
    _, batch = holdout(records, weights, c, 1)
    assert SpotTrainer(drafter, c).score(batch) == pytest.approx(report.heldout_kept, abs=1e-6)


def test_a_phase_that_only_makes_the_drafter_worse_publishes_nothing(target, records):
    """A phase whose every step scores below its start on the held-out responses (here: a learning rate
    that wrecks the drafter) leaves the drafter, its optimizer and its counters as they were, and the
    state it started from untouched (Adam updates its moments in place)."""
    import copy

    from tlt.spot.trainer import run_phase

    drafter = Drafter.from_target(target, seed=0)
    warm = SpotTrainer(drafter, small(max_steps=60))
    warm.train(batches_of(records, small()), lambda: False)
    start = warm.state_dict()
    before = copy.deepcopy(start)
    state, report = run_phase(drafter, start, records, [1.0] * len(records), small(holdout=0.25, max_steps=4, lr=3.0),
                              seed=2)
    assert report.steps == 4 and report.kept == 0 and report.heldout_kept == report.heldout_start
    assert state["version"] == before["version"] == 1 and state["steps"] == before["steps"] == 60
    for got in (drafter.state_dict(), state["drafter"], start["drafter"]):
        assert all(torch.equal(v, before["drafter"][k]) for k, v in got.items())
    for got in (state, start):
        moments = got["optimizer"]["state"]
        assert len(moments) == len(before["optimizer"]["state"]) > 0
        assert all(torch.equal(moments[i]["exp_avg"], s["exp_avg"]) and torch.equal(moments[i]["step"], s["step"])
                   for i, s in before["optimizer"]["state"].items())


def test_a_rejected_phase_is_not_taken_by_the_run(target, records):
    from tlt.spot.rollout import DrafterLearning
    from tlt.spot.trainer import PhaseReport

    learning = DrafterLearning(small(), Drafter.from_target(target, seed=0).config, log=lambda _: None)
    learning.accept({"version": 1}, PhaseReport(steps=3, kept=0), step=0)
    assert learning.state is None and learning.version == 0
    learning.accept({"version": 1}, PhaseReport(steps=3, kept=2), step=0)
    assert learning.version == 1


def test_a_stop_anywhere_leaves_the_best_scored_weights(target, records):
    """Stops before the first score, inside a step, inside a later score: whatever the trainer ends on
    scores what the report says, a step whose score the stop cut short is not kept, and nothing is kept
    when nothing scored above the start."""
    from tlt.spot.trainer import holdout

    c = small(holdout=0.25, unroll=2)
    weights = [1.0] * len(records)
    held, batch = holdout(records, weights, c, 0)
    kept = [r for j, r in enumerate(records) if j not in held]
    calls = {"n": 0}

    def counting(limit):
        def should_stop():
            calls["n"] += 1
            return calls["n"] > limit
        return should_stop

    marks = []  # the check count at the end of each optimizer step (before its score) in an unstopped run
    calls["n"] = 0
    SpotTrainer(Drafter.from_target(target, seed=0), small(holdout=0.25, unroll=2, max_steps=3)).train(
        batches_of(kept, c), counting(10**9), after_step=lambda s: marks.append(calls["n"]), heldout=batch)
    assert len(marks) == 3
    rolled_back = False
    for limit in (0, 1, marks[0] - 2, marks[0] + 1, marks[1] + 1, marks[2] + 1, marks[2] - 3):
        calls["n"] = 0
        trainer = SpotTrainer(Drafter.from_target(target, seed=0), c)
        start = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
        result = trainer.train(batches_of(kept, c), counting(limit), heldout=batch)
        assert result.stopped == "stop" and result.kept <= result.steps and trainer.steps == result.kept
        if result.heldout_kept is None:  # stopped before the start was scored: nothing changed
            assert result.kept == result.steps == 0
        else:
            assert trainer.score(batch) == pytest.approx(result.heldout_kept, abs=1e-6)
        if limit in (marks[0] + 1, marks[1] + 1, marks[2] + 1):  # stopped inside the score of the last step
            assert result.kept < result.steps
            rolled_back = rolled_back or result.kept > 0
        if result.kept == 0:
            assert all(torch.equal(v, start[k]) for k, v in trainer.drafter.state_dict().items())
            assert trainer.version == 0
    assert rolled_back  # some stop ended on an earlier step's weights, not the start's


def test_a_bf16_drafter_is_scored_as_its_float32_twin(target, records):
    """A bf16 engine's drafter trains and is scored as a float32 twin over float32 copies of the target's
    embedding and head (scoring runs without gradients, through the twin's own head)."""
    import copy

    from tlt.spot.trainer import run_phase

    drafter = Drafter.from_target(copy.deepcopy(target).to(torch.bfloat16), seed=0).eval()
    state, report = run_phase(drafter, None, records, [1.0] * len(records), small(holdout=0.25, max_steps=3), seed=0)
    assert report.steps == 3 and 0 < report.heldout_start < 1 and report.heldout_kept >= report.heldout_start
    assert all(v.dtype == torch.float32 for v in state["drafter"].values())
    assert all(v.dtype == torch.bfloat16 for v in drafter.state_dict().values())


def test_a_bf16_autocast_phase_learns_with_float32_weights_and_scores_under_autocast(target, records):
    """drafter.dtype=bfloat16: the training forwards and the held-out scoring run under bf16 autocast (the
    drafter's products come out bf16), the weights and the published state stay float32, and the drafter
    learns about as the float32 phase does; a dtype other than the two is refused, naming the field."""
    from tlt.speculative.train import acceptance_top1
    from tlt.spot.trainer import run_phase

    seen = []  # per fc call: the dtype of its output
    def trained(dtype, steps, holdout):
        drafter = Drafter.from_target(target, seed=0)
        hook = drafter.fc.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
        state, report = run_phase(drafter, None, records, [1.0] * len(records),
                                  small(max_steps=steps, holdout=holdout, dtype=dtype), seed=0)
        hook.remove()
        assert report.steps == steps and all(v.dtype == torch.float32 for v in state["drafter"].values())
        return drafter, report

    _, report = trained("bfloat16", 2, 0.25)  # scored before the first step and after each
    assert report.heldout_start is not None and set(seen) == {torch.bfloat16}
    seen.clear()
    before = acceptance_top1(Drafter.from_target(target, seed=0), records)
    drafter32, _ = trained("float32", 60, 0.0)
    assert set(seen) == {torch.float32}
    seen.clear()
    drafter16, _ = trained("bfloat16", 60, 0.0)
    assert set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in drafter16.parameters())
    after32, after16 = acceptance_top1(drafter32, records), acceptance_top1(drafter16, records)
    assert after16 > before + 0.2 and abs(after16 - after32) < 0.1, (before, after32, after16)
    with pytest.raises(ConfigError, match="dtype"):
        small(dtype="float16")
