"""The adaptive engine: strategy switching step by step stays lossless, the tuner is carried and
restored, the memory guard and the drafter requirement restrict the arms."""

import json

import torch

import tlt
from tlt.adaptive import TunerConfig
from test_speculative import (
    VOCAB, chi_square_pvalue, drafters_for, exact_three_token_distribution, random_target, tokens_of,
)


def adaptive_engine(target, drafter, **tuner):
    config = TunerConfig(**tuner)
    return tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="adaptive", drafter=drafter, tuner=config,
                                                             max_draft_tokens=10**7))


def test_greedy_adaptive_equals_plain_while_switching_arms():
    target = random_target(seed=12)
    drafter = drafters_for(target)["random"]
    prompts = [[4, 5, 6], [7, 8, 9, 10, 11], [3]]
    params = tlt.SamplingParams(n=2, temperature=0, max_tokens=60, ignore_eos=True)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    engine = adaptive_engine(target, drafter, epsilon=0.5, seed=3)
    assert tokens_of(engine.generate(prompts, params)) == tokens_of(plain)
    used = set(engine.stats()["strategies"])
    assert "off" in used and len(used) >= 4  # really switched, off <-> drafter arms included


def test_adaptive_sampling_is_exact():
    """Arms change between the steps of one rollout (prefill, then a tree, a chain and an n-gram step):
    the 3-token distribution must still be the target's."""
    target = random_target(vocab=VOCAB, seed=8, scale=0.6)
    prompt = list(range(VOCAB)) * 2
    drafter = drafters_for(target)["random"]
    engine = tlt.RolloutEngine(target, config=tlt.EngineConfig(
        speculative="adaptive", drafter=drafter, max_batch_size=50_000, max_draft_tokens=10**7,
        tuner=TunerConfig(arms=("tree-d3-k2-v5", "chain-d3", "off"), epsilon=0.0)))
    params = tlt.SamplingParams(n=50_000, temperature=1.0, max_tokens=3, seed=4, ignore_eos=True)
    seqs = torch.tensor([c.token_ids for c in engine.generate([prompt], params)[0].outputs])
    counts = torch.bincount((seqs * torch.tensor([VOCAB * VOCAB, VOCAB, 1])).sum(1), minlength=VOCAB**3)
    assert engine.stats()["strategies"][:2] == ["tree-d3-k2-v5", "chain-d3"]
    assert chi_square_pvalue(counts, exact_three_token_distribution(target, prompt, 1.0, -1, 1.0)) > 0.001


def test_tuner_is_carried_across_rollouts_and_restored():
    target = random_target(seed=13)
    drafter = drafters_for(target)["random"]
    params = tlt.SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=5, ignore_eos=True)
    engine = adaptive_engine(target, drafter, seed=1)
    engine.generate([[4, 5, 6, 7]], params)
    first = sum(b["steps"] for b in engine.stats()["tuner"]["buckets"])
    engine.generate([[8, 9, 10]], params)
    assert sum(b["steps"] for b in engine.stats()["tuner"]["buckets"]) > first  # one tuner, carried

    state = json.loads(json.dumps(engine.tuner.state_dict()))
    restored = adaptive_engine(target, drafter, seed=1)  # a fresh engine of the same config
    restored.tuner.load_state_dict(state)
    for _ in range(20):  # same state, same future choices
        assert engine.tuner.choose(3) == restored.tuner.choose(3)


def test_memory_guard_and_missing_drafter_restrict_the_arms():
    target = random_target(seed=14)
    params = tlt.SamplingParams(n=16, temperature=1.0, max_tokens=12, seed=6, ignore_eos=True)
    engine = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="adaptive", max_draft_tokens=32))
    engine.generate([[4, 5, 6]], params)
    for size, strategy in zip(engine.stats()["batch_sizes"], engine.stats()["strategies"]):
        assert strategy == "off" or strategy.startswith("ngram")  # no drafter loaded
        if strategy != "off":
            assert size * 5 <= 32  # ngram-d4 sends 5 tokens per row through verification
