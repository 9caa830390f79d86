"""Suffix and hybrid drafts from history are lossless: greedy token for token, sampling the very samples of
plain decoding with the same seeds, and in distribution (chi-square) with a history of adversarial
continuations."""

import itertools
import math

import pytest
import torch

import tlt
from tlt.adaptive import TunerConfig
from tlt.speculative import Drafter, Strategy
from tlt.speculative.history import HistoryDrafts

from test_speculative import (VOCAB, chi_square_pvalue, engine, exact_three_token_distribution, random_target,
                              tokens_of)

STRATEGIES = ["suffix-d8-v16", "hybrid-d3-k2-v8", "suffix-d8-v16-p30", "hybrid-d3-k2-v8-p20", "suffix-d8-v16-p30-c1",
              "suffix-d8-v16-p30-c0", "suffix-d8-v16-pa-c1"]


def least_likely_continuations(target, prompt, length, count):
    """`count` responses of `length` tokens, each step the token the target finds least likely (then the
    next least likely ones): a history that drafts only what the target rejects."""
    out = []
    for rank in range(count):
        seq = list(prompt)
        for _ in range(length):
            with torch.no_grad():
                logits = target(torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argsort()[rank % logits.shape[0]]))
        out.append(seq[len(prompt):])
    return out


def histories(target, prompts, params, kind):
    if kind == "none":
        return None
    if kind == "plain":  # the responses plain decoding gives with other seeds: often right
        from dataclasses import replace

        other = tlt.RolloutEngine(target).generate(prompts, replace(params, seed=(params.seed or 0) + 1))
        return HistoryDrafts([[c.token_ids for c in o.outputs] for o in other], window=[[5, 6, 7, 8, 9]])
    adversarial = [least_likely_continuations(target, p, 12, 3) for p in prompts]
    # the window too: every prompt's adversarial continuations, drafting wherever they match longest
    return HistoryDrafts(adversarial, window=[r for responses in adversarial for r in responses])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("history", ["none", "plain", "adversarial"])
def test_greedy_suffix_drafts_equal_plain(strategy, history):
    target = random_target()
    prompts = [torch.randint(3, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11, 7)]
    params = tlt.SamplingParams(n=2, temperature=0, max_tokens=40, ignore_eos=True)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    spec = engine(target, strategy, Drafter.from_target(target, seed=1))
    outputs = spec.generate(prompts, params, history=histories(target, prompts, params, history))
    assert tokens_of(outputs) == tokens_of(plain)
    assert spec.stats()["acceptance_length"] >= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("history", ["plain", "adversarial"])
def test_sampled_suffix_drafts_reproduce_plain_sampling(strategy, history, dtype):
    """Target-only verification draws each token with plain decoding's uniform for that position: with
    the same seeds the samples are plain decoding's, whatever the history proposes (in bf16 on tlt's
    kernels too, where rows of different draft sizes verify on their real tokens only)."""
    target = random_target(seed=4).to(dtype)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5]]
    params = tlt.SamplingParams(n=4, temperature=0.9, top_k=20, top_p=0.9, max_tokens=30, seed=11, ignore_eos=True)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    spec = engine(target, strategy, Drafter.from_target(target, seed=5))
    outputs = spec.generate(prompts, params, history=histories(target, prompts, params, history))
    assert tokens_of(outputs) == tokens_of(plain)
    for out, ref in zip(outputs, plain):
        for c, r in zip(out.outputs, ref.outputs):
            assert c.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    sources = spec.stats()["draft_sources"]
    assert sources and sum(v[0] for v in sources.values()) > 0
    if history == "plain":
        assert sources["history"][2] > 0  # history drafts were accepted, not only proposed


def test_each_step_counts_the_draft_tokens_it_verified():
    """The cost side of acceptance: an unpruned tree verifies all its nodes every row, a chain at most its
    depth, a suffix tree at most its budget."""
    target = random_target(seed=3)
    prompts = [[3, 4, 5, 3, 4], [7, 8, 7, 8]]
    params = tlt.SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=2, ignore_eos=True)
    for strategy, fits in [("tree-d4-k2-v8", lambda d, b: d == 8 * b), ("chain-d3", lambda d, b: d == 3 * b),
                           ("ngram-d4", lambda d, b: d <= 4 * b), ("suffix-d8-v16-p30", lambda d, b: d <= 16 * b),
                           ("tree-d4-k2-v8-p1", lambda d, b: d <= 8 * b),
                           ("hybrid-d3-k2-v8-p1", lambda d, b: d <= 8 * b)]:
        spec = engine(target, strategy, Drafter.from_target(target, seed=1))
        spec.generate(prompts, params, history=histories(target, prompts, params, "plain"))
        stats = spec.rollout_stats
        assert len(stats.step_drafted) == len(stats.step_tokens) and sum(stats.step_drafted) > 0
        assert all(fits(d, b) for d, b in zip(stats.step_drafted, stats.batch_sizes)), strategy


def test_an_auto_floor_drafts_what_the_measured_cost_allows():
    """A "-pa" suffix draft is cut where the decoder's StepCosts say: a high floor keeps fewer nodes than a low
    one, on the same samples (plain decoding's)."""
    target = random_target(seed=3)
    prompts = [[3, 4, 5, 3, 4], [7, 8, 7, 8]]
    params = tlt.SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=2, ignore_eos=True)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    drafted = {}
    for floor in (0.01, 0.95):
        spec = engine(target, "suffix-d8-v16-pa")
        asked = []
        spec.decoder.costs.floor = lambda rows, floor=floor: asked.append(rows) or floor
        assert tokens_of(spec.generate(prompts, params, history=histories(target, prompts, params, "plain"))) == \
            tokens_of(plain)
        drafted[floor] = sum(spec.rollout_stats.step_drafted)
        assert asked and set(asked) <= set(spec.rollout_stats.batch_sizes)
    assert drafted[0.95] < drafted[0.01]
    stats = spec.stats()["step_costs"]  # every step's cost was recorded, per bucket
    assert stats and sum(b["steps"] for b in stats.values()) > 0
    # an adaptive engine measures costs only where an arm drafts by them
    for arms, measured in ((("off", "suffix-d8-v16-pa"), True), (("off", "suffix-d8-v16-p30"), False)):
        adaptive = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="adaptive", tuner=TunerConfig(arms=arms)))
        assert (adaptive.decoder.costs is not None) == measured
    # and fits them over its tuner's buckets
    adaptive = tlt.RolloutEngine(target, config=tlt.EngineConfig(
        speculative="adaptive", tuner=TunerConfig(arms=("off", "suffix-d8-v16-pa"), buckets=(4, 32))))
    assert [adaptive.decoder.costs.bucket_of(b) for b in (4, 5, 32, 33)] == [0, 1, 1, 2]


def test_history_of_the_same_samples_is_accepted_whole():
    """A history holding the very responses about to be sampled drafts them: long acceptance."""
    target = random_target(seed=2)
    prompts = [[5, 6, 7, 8]]
    params = tlt.SamplingParams(n=4, temperature=1.0, max_tokens=60, seed=3, ignore_eos=True)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    spec = engine(target, "suffix-d16-v32")
    outputs = spec.generate(prompts, params, history=HistoryDrafts([[c.token_ids for c in plain[0].outputs]]))
    assert tokens_of(outputs) == tokens_of(plain)
    assert spec.stats()["acceptance_length"] >= 6.0


def test_adaptive_engine_with_suffix_arms_equals_plain():
    target = random_target(seed=6)
    prompts = [[3, 4, 5], [7, 8]]
    params = tlt.SamplingParams(n=3, temperature=1.0, max_tokens=40, seed=5, ignore_eos=True)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    tuner = TunerConfig(arms=("off", "ngram-d4", "suffix-d8-v16", "hybrid-d3-k2-v8"), epsilon=0.5)
    spec = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="adaptive", tuner=tuner,
                                                               drafter=Drafter.from_target(target, seed=1)))
    history = histories(target, prompts, params, "plain")
    assert tokens_of(spec.generate(prompts, params, history=history)) == tokens_of(plain)
    ran = set(spec.stats()["strategies"])
    assert {"suffix-d8-v16", "hybrid-d3-k2-v8"} <= ran


def test_sampling_with_an_adversarial_history_is_exact():
    target = random_target(vocab=VOCAB, seed=8, scale=0.6)
    prompt = list(range(VOCAB)) * 2
    history = least_likely_continuations(target, prompt, 3, VOCAB) + \
        [list(c) for c in itertools.product(range(VOCAB), repeat=3) if sum(c) % 7 == 0][:24]
    # a window of other continuations after the prompt's tail: it drafts where the group's match is the shorter
    window = [prompt[-3:] + list(c) for c in itertools.product(range(VOCAB), repeat=3) if sum(c) % 5 == 1][:24]
    spec = engine(target, "suffix-d3-v6", max_batch_size=20_000)
    params = tlt.SamplingParams(n=20_000, temperature=1.0, top_k=5, max_tokens=3, seed=1, ignore_eos=True)
    drafts = HistoryDrafts([history], window=window)
    seqs = torch.tensor([c.token_ids for c in spec.generate([prompt], params, history=drafts)[0].outputs])
    counts = torch.bincount((seqs * torch.tensor([VOCAB * VOCAB, VOCAB, 1])).sum(1), minlength=VOCAB ** 3)
    assert chi_square_pvalue(counts, exact_three_token_distribution(target, prompt, 1.0, 5, 1.0)) > 0.001
    sources = spec.stats()["draft_sources"]
    assert sources["history"][2] > 0 and sources["window"][2] > 0  # both drafted, and some of each accepted


def test_strategy_names_of_the_new_arms():
    for name in ("suffix-d16-v32", "hybrid-d4-k2-v16", "suffix-d16-v32-p20", "hybrid-d4-k2-v16-p10", "suffix-d16-v32-p20-c1",
                 "suffix-d16-v32-p20-c0", "suffix-d16-v32-pa-c1", "suffix-d16-v32-pa"):
        assert Strategy.parse(name).name == name and Strategy.parse(name).target_only
    assert [Strategy.parse(f"suffix-d16-v32{c}").calibrated for c in ("-c0", "-c1", "")] == [0, 1, 2]
    for refused in ("tree-d4-k2-v8-c0", "tree-d4-k2-v8-c1", "suffix-d16-v32-c3"):
        with pytest.raises(tlt.ConfigError, match="calibrated"):
            Strategy.parse(refused)
    assert Strategy.parse("hybrid-d4-k2-v16-p10").learned_tree.name == "tree-d4-k2-v16-p10"
    for refused in ("ngram-d4-p20", "suffix-d16-v32-p100", "tree-d4-k2-v8-pa", "hybrid-d4-k2-v16-pa", "suffix-d16-v32-pb"):
        with pytest.raises(tlt.ConfigError, match="prune|cannot parse"):
            Strategy.parse(refused)
    assert Strategy.parse("suffix-d16-v32-pa").auto_floor and not Strategy.parse("suffix-d16-v32-p25").auto_floor
    assert Strategy.parse("suffix-d16-v32-p25").floor == pytest.approx(math.log(0.25))
    with pytest.raises(ValueError, match="measured step costs"):  # no fixed value to hand a tree's pruning
        Strategy.parse("suffix-d16-v32-pa").floor
    assert Strategy.parse("hybrid-d4-k2-v16").uses_drafter and not Strategy.parse("suffix-d16-v32").uses_drafter
    with pytest.raises(tlt.ConfigError):
        Strategy.parse("hybrid-d8-k2-v4")


def test_the_calibration_learns_during_a_rollout_and_travels_with_the_drafting_state():
    """A suffix rollout fills the decoder's calibration from its verifications; `drafting_state` carries it
    (and the tuner's state) to a fresh engine, which then drafts as the first would."""
    target = random_target()
    prompts = [torch.randint(3, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11)]
    params = tlt.SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=3, ignore_eos=True)
    history = histories(target, prompts, params, "plain")
    first = engine(target, "suffix-d8-v16-p30")
    first.generate(prompts, params, history=history)
    table = first.decoder.calibration.table
    assert table and sum(r for r, _ in table.values()) > 0
    state = first.drafting_state()
    assert state["tuner"] is None and state["calibration"]["table"]
    second = engine(target, "suffix-d8-v16-p30")
    second.load_drafting_state(state)
    assert second.decoder.calibration.table == table and second.decoder.calibration.by_match == first.decoder.calibration.by_match
    first.reset_stats()
    again = [first.generate(prompts, params, history=history), second.generate(prompts, params, history=history)]
    assert tokens_of(again[0]) == tokens_of(again[1])
    assert first.stats()["step_drafted"] == second.stats()["step_drafted"]  # the same drafts, step by step
    assert first.decoder.calibration.state_dict() == second.decoder.calibration.state_dict()
    assert tlt.RolloutEngine(target).drafting_state() is None


def test_each_calibration_level_drafts_by_its_own_estimates(monkeypatch):
    """The decoder hands the suffix drafter the calibration the arm names: the matched-length estimates by
    default, the counts-only ones under -c1, none (raw frequencies) under -c0."""
    from tlt.speculative.suffix import Calibration, SuffixIndex, _CountsOnly

    target = random_target()
    prompts = [torch.randint(3, 61, (6,), generator=torch.Generator().manual_seed(6)).tolist()]
    params = tlt.SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    history = histories(target, prompts, params, "plain")
    seen = []
    tree = SuffixIndex.tree
    monkeypatch.setattr(SuffixIndex, "tree", lambda self, *args: seen.append(args[4]) or tree(self, *args))
    for name, kind in (("suffix-d8-v16-p30", Calibration), ("suffix-d8-v16-p30-c1", _CountsOnly),
                       ("suffix-d8-v16-p30-c0", type(None))):
        seen.clear()
        spec = engine(target, name)
        spec.generate(prompts, params, history=history)
        assert seen and all(type(c) is kind for c in seen), name
        if kind is _CountsOnly:
            assert all(c.calibration is spec.decoder.calibration for c in seen)


def test_the_first_rollout_with_history_makes_the_tuner_measure_the_history_arms_afresh():
    """Measured without history, a suffix arm's rewards say little about it with history: the first rollout
    that brings earlier responses clears them (the other arms keep theirs), once per run; the flag travels
    in the tuner's state."""
    target = random_target(seed=6)
    prompts = [[3, 4, 5], [7, 8]]
    params = tlt.SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=5, ignore_eos=True)
    tuner = TunerConfig(arms=("off", "ngram-d4", "suffix-d8-v16"))
    spec = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="adaptive", tuner=tuner))
    spec.generate(prompts, params)
    windows = {a.name: sum(len(b.windows[a]) for b in spec.tuner._buckets) for a in spec.tuner.arms}
    assert windows["suffix-d8-v16"] > 0 and windows["ngram-d4"] > 0 and not spec.tuner.history_seen
    history = histories(target, prompts, params, "plain")
    spec.tuner.forget = forget = _Spy(spec.tuner.forget)
    spec.generate(prompts, params, history=history)
    assert forget.calls == [["suffix-d8-v16"]] and spec.tuner.history_seen
    spec.generate(prompts, params, history=history)
    assert len(forget.calls) == 1  # once per run
    state = spec.drafting_state()
    assert state["tuner"]["history_seen"] is True and state["calibration"]["table"]


class _Spy:
    def __init__(self, function):
        self.function, self.calls = function, []

    def __call__(self, arms):
        self.calls.append([a.name for a in arms])
        return self.function(arms)


def test_drafting_states_of_every_version_load_and_a_bad_one_changes_nothing(tmp_path):
    """A checkpoint's drafting.json holds {"workers": [...]}; earlier versions wrote tuner.json, {"tuners": [...]}
    or one tuner's state alone: all are read. A drafting state whose calibration is out of bounds (an estimate
    above 1 would break the drafts' best-first order) is refused before the tuner is touched."""
    import json

    from tlt.errors import CheckpointError
    from tlt.rl.checkpoint import read_drafting

    target = random_target(seed=6)
    tuner = TunerConfig(arms=("off", "ngram-d4", "suffix-d8-v16"))
    spec = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="adaptive", tuner=tuner))
    spec.generate([[3, 4, 5]], tlt.SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=5, ignore_eos=True))
    state = spec.drafting_state()
    for name, saved in (("drafting.json", {"workers": [state, None]}), ("tuner.json", {"tuners": [state["tuner"]]}),
                        ("tuner.json", state["tuner"])):
        (tmp_path / name).write_text(json.dumps(saved))
        states = read_drafting(tmp_path / name)
        fresh = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="adaptive", tuner=tuner))
        fresh.load_drafting_state(states[0])
        assert fresh.tuner.state_dict() == spec.tuner.state_dict()
    (tmp_path / "drafting.json").write_text(json.dumps({"tuners": []}))
    with pytest.raises(CheckpointError, match="drafting.json: not a drafting state"):
        read_drafting(tmp_path / "drafting.json")
    fresh = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="adaptive", tuner=tuner))
    before = fresh.tuner.state_dict()
    bad = {"tuner": state["tuner"], "calibration": {"table": [[1, 0, 2.0, 3.0]]}}
    with pytest.raises(ValueError, match="calibration key"):
        fresh.load_drafting_state(bad)
    assert fresh.tuner.state_dict() == before and fresh.decoder.calibration.table == {}
    with pytest.raises(ValueError, match="holds 'tuner' and 'calibration'"):
        fresh.load_drafting_state({})
