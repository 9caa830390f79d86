"""The adaptive engine: strategy switching step by step stays lossless, the tuner is carried and
restored, the memory guard and the drafter requirement restrict the arms."""

import json

import pytest
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


@pytest.mark.parametrize("kind,temperature,top_k,top_p", [
    ("random", 1.0, -1, 1.0), ("adversarial", 1.3, 5, 1.0), ("trained", 0.6, -1, 0.8),
])
def test_adaptive_sampling_is_exact(kind, temperature, top_k, top_p):
    """Arms change between the steps of one rollout (a tree, a chain, then an n-gram step): the
    3-token distribution must still be the target's."""
    target = random_target(vocab=VOCAB, seed=8, scale=0.6)
    prompt = list(range(VOCAB)) * 2
    drafter = drafters_for(target, prompt if kind == "trained" else None)[kind]
    engine = tlt.RolloutEngine(target, config=tlt.EngineConfig(
        speculative="adaptive", drafter=drafter, max_batch_size=50_000, max_draft_tokens=10**7,
        tuner=TunerConfig(arms=("tree-d3-k2-v5", "chain-d3", "ngram-d3", "off"), epsilon=0.0)))
    params = tlt.SamplingParams(n=50_000, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3, seed=4,
                                ignore_eos=True)
    seqs = torch.tensor([c.token_ids for c in engine.generate([prompt], params)[0].outputs])
    counts = torch.bincount((seqs * torch.tensor([VOCAB * VOCAB, VOCAB, 1])).sum(1), minlength=VOCAB**3)
    steps = engine.stats()["strategies"]
    # A trained drafter can finish all 3 tokens in the first (tree) step; the others switch arms mid-rollout.
    expected = ["tree-d3-k2-v5"] if kind == "trained" else ["tree-d3-k2-v5", "chain-d3"]
    assert steps[: len(expected)] == expected
    probs = exact_three_token_distribution(target, prompt, temperature, top_k, top_p)
    assert chi_square_pvalue(counts, probs) > 0.001


def test_adaptive_logprobs_and_features_equal_full_forward():
    from tlt.rollout.sampling import warp_logprobs

    target = random_target(seed=16)
    prompt = [3, 9, 27, 4, 5]
    params = tlt.SamplingParams(n=3, temperature=0.8, top_k=20, max_tokens=40, seed=2, ignore_eos=True,
                                return_hidden_states=True)
    engine = adaptive_engine(target, drafters_for(target)["random"], epsilon=0.5, seed=2)
    out = engine.generate([prompt], params)[0]
    assert len(set(engine.stats()["strategies"])) >= 3
    for c in out.outputs:
        with torch.no_grad():
            full = target(torch.tensor([prompt + c.token_ids]))
        n = len(c.token_ids)
        warped = warp_logprobs(full.logits[0, len(prompt) - 1 : -1], torch.full((n,), 0.8), torch.full((n,), 20),
                               torch.ones(n))
        ref = warped.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert (torch.tensor(c.logprobs) - ref).abs().max() <= 1e-4
        assert (c.hidden_states - full.hidden_states[0, len(prompt) - 1 : -1]).abs().max() <= 1e-4


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


def test_draft_state_take_keeps_each_rows_newest_pairs():
    from tlt.speculative.decoder import DraftState

    features = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    tokens = torch.arange(16).view(2, 8)
    def state():
        return DraftState(None, features.clone(), tokens.clone(), torch.tensor([3, 7]), torch.tensor([10, 20]))

    feats, toks, positions, valid, count = state().take(4)
    assert count.tolist() == [3, 4]
    assert valid.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert toks[0, :3].tolist() == [0, 1, 2] and toks[1].tolist() == [11, 12, 13, 14]  # row 1: its last 4 of 7
    assert positions[0, :3].tolist() == [10, 11, 12] and positions[1].tolist() == [23, 24, 25, 26]
    assert torch.equal(feats[1], features[1, 3:7]) and torch.equal(feats[0, :3], features[0, :3])
    everything = state().take(None)
    for a, b in zip(state().take(7), everything):  # a window no row exceeds takes everything
        assert torch.equal(a, b)
    assert everything[4].tolist() == [3, 7] and everything[2][1].tolist() == list(range(20, 27))


def test_bounded_pending_pairs_take_what_unbounded_ones_take():
    """Runs of plain steps (a pair per row), verifications (several) and row removals, with the buffer bounded
    to the catch-up window after every add and without: each `take(window)` returns the same pairs at the same
    positions, and the bounded buffer's width stays within four windows plus one add (it grows by doubling and is
    cut back to one window once past two)."""
    from tlt.speculative.decoder import DraftState

    gen = torch.Generator().manual_seed(3)
    window, B, H = 4, 5, 3
    no_cache = type("NoCache", (), {"select_rows": lambda self, rows: None})()  # only the pending pairs are tested
    def fresh():
        return DraftState(no_cache, torch.zeros(B, 0, H), torch.zeros(B, 0, dtype=torch.long),
                          torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long))
    bounded, full, position, widest = fresh(), fresh(), torch.arange(B) * 100, 0
    for step in range(60):
        rows = len(position)
        K = 1 if step % 7 else 3  # mostly plain steps
        k = torch.randint(1, K + 1, (rows,), generator=gen)
        feats, toks = torch.randn(rows, K, H, generator=gen), torch.randint(0, 50, (rows, K), generator=gen)
        for state in (bounded, full):
            state.add(feats, toks, k, position)
        bounded.bound(window)
        widest = max(widest, full.tokens.shape[1])
        position = position + k
        assert bounded.tokens.shape[1] <= 4 * window + K
        if step % 11 == 10 and rows > 2:  # a row finishes
            keep = torch.tensor([r for r in range(rows) if r != step % rows])
            position = position[keep]
            for state in (bounded, full):
                state.select(keep)
        if step % 13 == 12:  # a drafting step consumes the pending pairs
            got, want = bounded.take(window), full.take(window)
            assert torch.equal(got[4], want[4])
            for b, n in enumerate(want[4].tolist()):
                for a, c in zip(got[:3], want[:3]):
                    assert torch.equal(a[b, :n], c[b, :n])
    assert widest > 4 * window + 3  # unbounded, plain steps widen the buffer


def windowed_run(n: int, temperature: float, max_tokens: int):
    """The random target and drafter of the window tests, their two prompts and sampling parameters, and
    plain decoding's outputs for them."""
    target = random_target(seed=15)
    drafter = drafters_for(target)["random"]
    prompts = [[4, 5, 6], [7, 8, 9, 10, 11]]
    params = tlt.SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=9, ignore_eos=True)
    return target, drafter, prompts, params, tlt.RolloutEngine(target).generate(prompts, params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_catch_up_window_of_one_stays_lossless(temperature, monkeypatch):
    """Drafting after runs of plain steps with the drafter fed only each row's newest pair: the
    output is still plain decoding's, token for token (greedy, and sampled with target-only
    verification, whose draws are plain sampling's)."""
    from tlt.speculative.decoder import DraftState

    windowed = []  # per catch-up or bound: whether some row had more pairs pending than the window
    take, bound = DraftState.take, DraftState.bound

    def spy(self, window=None):
        windowed.append(window is not None and int(self.count.max()) > window)
        return take(self, window)

    def bound_spy(self, window):
        windowed.append(int(self.count.max()) > window)
        bound(self, window)

    monkeypatch.setattr(DraftState, "take", spy)
    monkeypatch.setattr(DraftState, "bound", bound_spy)
    target, drafter, prompts, params, plain = windowed_run(3, temperature, 60)
    arms = ("off", "tree-d4-k3-v10", "ngram-d3") + (("chain-d3",) if temperature == 0 else ())
    engine = tlt.RolloutEngine(target, config=tlt.EngineConfig(
        speculative="adaptive", drafter=drafter, catch_up_window=1, max_draft_tokens=10**7,
        tuner=TunerConfig(arms=arms, epsilon=0.5, seed=2)))
    assert tokens_of(engine.generate(prompts, params)) == tokens_of(plain)
    assert any(windowed)  # some drafting step really left pairs out


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_catch_up_window_is_validated(window):
    with pytest.raises(tlt.ConfigError, match="catch_up_window"):
        tlt.EngineConfig(catch_up_window=window)


@pytest.mark.parametrize("window", [0, -1, 1.5, False, "8", "Auto"])
def test_drafter_window_is_validated(window):
    with pytest.raises(tlt.ConfigError, match="drafter_window"):
        tlt.EngineConfig(drafter_window=window)


def test_auto_drafter_window_is_a_quarter_of_the_window_the_drafter_was_trained_over():
    from dataclasses import replace

    from tlt.speculative.decoder import SpeculativeDecoder

    target = random_target(seed=15)
    drafter = drafters_for(target)["random"]
    assert tlt.EngineConfig().drafter_window == "auto"
    unrecorded = SpeculativeDecoder.from_config(target, tlt.EngineConfig(speculative="on", drafter=drafter))
    assert drafter.config.train_window is None and unrecorded.drafter_window is None  # the whole context
    drafter.config = replace(drafter.config, train_window=300)
    for window, expected in (("auto", 75), (None, None), (64, 64)):
        config = tlt.EngineConfig(speculative="on", drafter=drafter, drafter_window=window)
        assert SpeculativeDecoder.from_config(target, config).drafter_window == expected
    adaptive = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="adaptive", drafter=drafter))
    assert adaptive.decoder.spec.drafter_window == 75


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_state_trim_keeps_the_newest_pairs_of_rows_past_twice_the_window(dtype):
    from tlt.model.kv_cache import KVCache
    from tlt.speculative.decoder import DraftState

    cache = KVCache(1, 3, 2, 16, dtype=dtype)  # bf16 on the CPU: paired values, moved by the kernel where built
    k = torch.randn(3, 2, 11, 16).to(dtype)
    v = torch.randn(3, 2, 11, 16).to(dtype)
    cache.write(0, k, v)
    cache.advance(torch.tensor([11, 8, 9]))  # rows of 11, 8 and 9 pairs
    state = DraftState(cache, torch.zeros(3, 0, 16), torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                       torch.zeros(3, dtype=torch.long))
    state.trim(4)
    assert cache.lengths.tolist() == [4, 8, 4]  # past 2 x 4: the newest 4 kept; exactly 8: left as it is
    keys, values = _keys(cache), _values(cache)
    for row, (length, kept) in enumerate(((11, 4), (8, 8), (9, 4))):
        assert torch.equal(keys[row, :, :kept], k[row, :, length - kept : length])
        assert torch.equal(values[row, :, :kept], v[row, :, length - kept : length])
    state.trim(4)  # nothing past twice the window now
    assert cache.lengths.tolist() == [4, 8, 4]


def _keys(cache):
    """Layer 0's cached keys in the usual [B, H_kv, C, D] layout, whatever the cache's."""
    from tlt.model import kv_cache

    keys = cache.keys[0]
    return kv_cache.natural_keys(keys) if cache.packed_keys else keys


def _values(cache):
    """Layer 0's cached values in the usual [B, H_kv, C, D] layout, whatever the cache's."""
    from tlt.model import kv_cache

    values = cache.values[0]
    return kv_cache.natural(values) if cache.paired else values


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_drafter_window_stays_lossless_and_bounds_the_drafters_cache(temperature, monkeypatch):
    """Tree drafting whose drafter attends to each row's newest 4 to 8 pairs only: the output is still
    plain decoding's token for token (greedy, and sampled with target-only verification), and the
    drafter's cache really was cut back (it holds at most twice the window after every trim)."""
    from tlt.speculative.decoder import DraftState

    trimmed = []  # per trim: the rows' drafter cache lengths before and after
    trim = DraftState.trim

    def spy(self, window):
        before = self.cache.lengths.tolist()
        trim(self, window)
        trimmed.append((before, self.cache.lengths.tolist()))

    monkeypatch.setattr(DraftState, "trim", spy)
    target, drafter, prompts, params, plain = windowed_run(2, temperature, 40)
    engine = tlt.RolloutEngine(target, config=tlt.EngineConfig(
        speculative="on", strategy="tree-d3-k2-v6", drafter=drafter, drafter_window=4))
    assert tokens_of(engine.generate(prompts, params)) == tokens_of(plain)
    assert any(max(before) > 8 for before, _ in trimmed)  # rows grew past twice the window ...
    assert all(max(after) <= 8 for _, after in trimmed)  # ... and were cut back


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_default_arms_draw_plain_decodings_very_samples(warp):
    """Every default arm verifies target-only, so the adaptive engine returns what plain decoding
    returns with the same seeds, token for token, whatever arms it switches between."""
    assert all(tlt.Strategy.parse(a).kind != "chain" for a in TunerConfig().arms)
    target = random_target(seed=16)
    prompts = [[4, 5, 6], [7, 8, 9, 10, 11], [3]]
    params = tlt.SamplingParams(n=4, max_tokens=40, seed=21, ignore_eos=True, **warp)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    for kind in ("random", "adversarial"):
        engine = adaptive_engine(target, drafters_for(target)[kind], epsilon=0.5, seed=4)
        assert tokens_of(engine.generate(prompts, params)) == tokens_of(plain)
        assert len(set(engine.stats()["strategies"])) >= 4  # really switched arms
