"""The rollout engine against transformers and against exact distributions."""

import itertools
import math

import numpy as np
import pytest
import torch

import tlt
from tlt.rollout.sampling import warp_logprobs
from tlt.tasks import CharTokenizer


@pytest.fixture
def qwen2(hf_folder):
    hf, folder = hf_folder("qwen2", seed=7)
    return hf, tlt.load_model(folder)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]


def test_greedy_equals_transformers_generate(qwen2):
    hf, model = qwen2
    prompts = prompts_of([5, 12, 9, 3, 17])
    outs = tlt.RolloutEngine(model).generate(prompts, tlt.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    # transformers pads on the left for batched generation; run it batched as users would.
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref[i, width:].tolist()
        assert out.outputs[0].finish_reason == "length"


def hf_warp(logits, temperature, top_k, top_p):
    """The exact warped distribution, computed by transformers' own logits processors."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.clone()[None]
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores[0].log_softmax(-1)


WARPS = [(0.7, -1, 1.0), (1.0, -1, 0.9), (1.0, 20, 1.0), (0.7, 20, 0.9)]


@pytest.mark.parametrize("temperature,top_k,top_p", WARPS)
def test_warping_matches_transformers(temperature, top_k, top_p):
    logits = torch.randn(5, 97) * 3
    ours = warp_logprobs(logits, torch.full((5,), temperature), torch.full((5,), top_k), torch.full((5,), top_p))
    for r in range(5):
        ref = hf_warp(logits[r], temperature, top_k, top_p)
        kept = ref > float("-inf")
        assert torch.equal(kept, ours[r] > float("-inf"))
        assert (ours[r][kept] - ref[kept]).abs().max() <= 1e-5


def test_logprobs_equal_full_forward_under_warping(qwen2):
    _, model = qwen2
    prompts = prompts_of([4, 11, 7])
    params = tlt.SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, max_tokens=24, seed=3, ignore_eos=True)
    outs = tlt.RolloutEngine(model).generate(prompts, params)
    for p, out in zip(prompts, outs):
        for c in out.outputs:
            seq = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                logits = model(seq).logits[0, len(p) - 1 : -1]  # [n, V]: position before each token
            n = len(c.token_ids)
            warped = warp_logprobs(logits, torch.full((n,), 0.7), torch.full((n,), 20), torch.full((n,), 0.9))
            ref = warped.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert (torch.tensor(c.logprobs) - ref).abs().max() <= 1e-4


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square against `probs`, merging cells expected below 5 into one."""
    from scipy.stats import chisquare

    n = int(counts.sum())
    expected = probs.double() * n
    assert int(counts[probs == 0].sum()) == 0, "a token with zero probability was sampled"
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:  # fold a still-tiny remainder into the smallest kept cell
        obs[-2] += obs[-1]
        exp[-2] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), exp.numpy() * (obs.sum() / exp.sum()).item()).pvalue)


@pytest.mark.parametrize("temperature,top_k,top_p", WARPS)
def test_first_token_distribution_is_exact(qwen2, temperature, top_k, top_p):
    _, model = qwen2
    prompt = prompts_of([6], seed=11)[0]
    n = 20_000
    engine = tlt.RolloutEngine(model, config=tlt.EngineConfig(max_batch_size=n))
    params = tlt.SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=1, seed=5)
    first = torch.tensor([c.token_ids[0] for c in engine.generate([prompt], params)[0].outputs])
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    probs = hf_warp(logits, temperature, top_k, top_p).exp()
    assert chi_square_pvalue(torch.bincount(first, minlength=97), probs) > 0.001
    assert engine.stats()["prefill_tokens"] == len(prompt)  # 20k samples, one prefill


def test_chi_square_detects_a_wrong_distribution(qwen2):
    """Guards the test above: sampling at the wrong temperature must fail it."""
    _, model = qwen2
    prompt = prompts_of([6], seed=11)[0]
    n = 20_000
    engine = tlt.RolloutEngine(model, config=tlt.EngineConfig(max_batch_size=n))
    params = tlt.SamplingParams(n=n, temperature=0.8, max_tokens=1, seed=5)
    first = torch.tensor([c.token_ids[0] for c in engine.generate([prompt], params)[0].outputs])
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    assert chi_square_pvalue(torch.bincount(first, minlength=97), hf_warp(logits, 0.7, -1, 1.0).exp()) < 1e-6


def test_same_seed_same_output_whatever_shares_the_batch(qwen2):
    _, model = qwen2
    target = prompts_of([8], seed=2)[0]
    params = tlt.SamplingParams(n=3, temperature=1.0, top_p=0.95, max_tokens=30, seed=1234, ignore_eos=True)
    alone = tlt.RolloutEngine(model).generate([target], params)[0]
    others = prompts_of([3, 15, 6, 10], seed=9)
    mixed = tlt.RolloutEngine(model, config=tlt.EngineConfig(seed=99)).generate(
        others[:2] + [target] + others[2:], [tlt.SamplingParams(n=2, max_tokens=40)] * 2 + [params]
        + [tlt.SamplingParams(max_tokens=5)] * 2
    )[2]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) == 3  # the n samples differ from each other


def test_stop_tokens_and_length_limits(qwen2):
    _, model = qwen2
    engine = tlt.RolloutEngine(model)
    prompt = prompts_of([5])[0]
    free = engine.generate([prompt], tlt.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    stop_at = free.token_ids[10]
    first = free.token_ids.index(stop_at)
    out = engine.generate([prompt], tlt.SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_at],
                                                       ignore_eos=True))[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    short = engine.generate([prompt], tlt.SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert short.token_ids == free.token_ids[:7] and short.finish_reason == "length"
    # The model's own eos id (2 in the fixture config) stops generation unless ignore_eos.
    out = engine.generate([prompt], tlt.SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[]))[0].outputs[0]
    assert 2 not in out.token_ids[:-1]


def test_context_limits_and_empty_input(qwen2):
    _, model = qwen2
    engine = tlt.RolloutEngine(model)
    assert engine.generate([]) == []
    with pytest.raises(tlt.ConfigError, match="prompt 1 has 256 tokens.*context"):
        engine.generate([[5, 6], [7] * 256])
    with pytest.raises(tlt.ConfigError, match="prompt 0 is empty"):
        engine.generate([[]])
    out = engine.generate([[5] * 250], tlt.SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_continuous_batching_respects_limits_and_changes_nothing(qwen2):
    _, model = qwen2
    prompts = prompts_of([4, 9, 6, 12, 5, 7])
    params = [tlt.SamplingParams(n=2, max_tokens=m, seed=i, ignore_eos=True) for i, m in enumerate([30, 5, 12, 3, 20, 8])]
    free = tlt.RolloutEngine(model).generate(prompts, params)
    engine = tlt.RolloutEngine(model, config=tlt.EngineConfig(max_batch_size=4))
    tight = engine.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in free] == [[c.token_ids for c in o.outputs] for o in tight]
    sizes = engine.stats()["batch_sizes"]
    assert max(sizes) <= 4 and sizes.count(4) > 1

    budget = 2 * (12 + 30)  # one group of the largest request at a time
    engine = tlt.RolloutEngine(model, config=tlt.EngineConfig(kv_budget_tokens=budget))
    queued = engine.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in free] == [[c.token_ids for c in o.outputs] for o in queued]
    with pytest.raises(tlt.ConfigError, match="needs .* KV tokens"):
        tlt.RolloutEngine(model, config=tlt.EngineConfig(kv_budget_tokens=40)).generate(prompts, params)


def test_batch_shrinks_as_sequences_finish(qwen2):
    _, model = qwen2
    lengths = [40, 3, 25, 8, 15]
    engine = tlt.RolloutEngine(model)
    engine.generate(prompts_of([5] * 5), [tlt.SamplingParams(max_tokens=m, ignore_eos=True) for m in lengths])
    sizes = engine.stats()["batch_sizes"]
    assert sizes[0] == 5 and sizes[-1] == 1 and all(a >= b for a, b in zip(sizes, sizes[1:]))
    assert len(sizes) == max(lengths) - 1  # the first token comes from the prefill


def test_a_step_that_decodes_nothing_records_no_step(qwen2):
    """Rows that all end at their prefill's token decode nothing: the per-step lists stay one entry a decode
    step (the bucket timings zip them), the prefill counted."""
    from tlt.adaptive.tuner import Tuner
    from tlt.bench.rollout import bucket_split

    _, model = qwen2
    engine = tlt.RolloutEngine(model, config=tlt.EngineConfig(max_batch_size=2))
    # two requests a batch: the first pair ends at prefill, the second decodes 3 steps
    out = engine.generate(prompts_of([5, 5, 5, 5]), [tlt.SamplingParams(max_tokens=m, ignore_eos=True)
                                                      for m in (1, 1, 4, 4)])
    assert [len(o.outputs[0].token_ids) for o in out] == [1, 1, 4, 4]
    stats = engine.rollout_stats
    assert stats.steps == len(stats.step_times) == len(stats.batch_sizes) == 3 and stats.prefill_tokens == 20
    assert bucket_split(stats.step_times, stats.step_tokens, stats.batch_sizes, Tuner())["tokens"]["2"] == 6


def test_hidden_states_come_from_the_decoding_forwards(qwen2):
    _, model = qwen2
    prompt = prompts_of([6])[0]
    out = tlt.RolloutEngine(model).generate(
        [prompt], tlt.SamplingParams(n=2, max_tokens=12, seed=0, return_hidden_states=True, ignore_eos=True)
    )[0]
    for c in out.outputs:
        with torch.no_grad():
            full = model(torch.tensor([prompt + c.token_ids])).hidden_states[0]
        assert c.hidden_states.shape == (12, 64)
        assert (c.hidden_states - full[len(prompt) - 1 : -1]).abs().max() <= 1e-5


def test_string_prompts_with_a_tokenizer(qwen2):
    from tlt.tasks import CharTokenizer

    _, model = qwen2
    tok = CharTokenizer()
    out = tlt.RolloutEngine(model, tok).generate(["Q:12+3\nA:"], tlt.SamplingParams(max_tokens=5, seed=0))[0]
    assert out.prompt_token_ids == tok.encode("Q:12+3\nA:")
    assert out.prompt == "Q:12+3\nA:" and isinstance(out.outputs[0].text, str)
    with pytest.raises(tlt.ConfigError, match="no tokenizer"):
        tlt.RolloutEngine(model).generate(["text"])


def test_sampling_params_validation():
    for bad in (dict(n=0), dict(temperature=-1), dict(top_p=0), dict(top_k=0), dict(max_tokens=0)):
        with pytest.raises(tlt.ConfigError, match=next(iter(bad))):
            tlt.SamplingParams(**bad)
    assert math.isclose(tlt.SamplingParams(top_p=0.5).top_p, 0.5)


def test_progress_bar_draws_only_when_enabled():
    import io

    from tlt.progress import Progress

    stream = io.StringIO()
    bar = Progress(10, "rollout", enabled=True, stream=stream)
    bar.update(10, "live 0")
    bar.close()
    assert "rollout [" in stream.getvalue() and "10/10" in stream.getvalue()
    quiet = io.StringIO()
    Progress(10, "rollout", enabled=None, stream=quiet).update(10)  # not a terminal: nothing drawn
    assert quiet.getvalue() == ""



def test_uniform_draws_do_not_depend_on_how_many_are_drawn_at_once(monkeypatch):
    """Small CPU draws are computed with Python ints, larger ones with tensor operators: a row's draw
    must be the same bits either way, or its sample would change with the live batch size."""
    from tlt.rollout import rng

    keys = torch.tensor([rng.sequence_key(seed, seed % 4) for seed in range(200)])  # negative keys included
    counters = torch.randint(0, 1 << 40, (200,), generator=torch.Generator().manual_seed(0))
    for stream in (0, 1, 3):
        together = rng.uniform(keys, counters, stream)  # 200 > rng.SMALL: tensor operators
        apart = torch.cat([rng.uniform(keys[i : i + 8], counters[i : i + 8], stream) for i in range(0, 200, 8)])
        assert torch.equal(together, apart)
        assert ((together >= 0) & (together < 1)).all() and together.unique().numel() == 200
        monkeypatch.setattr(rng, "SMALL", 1000)
        assert torch.equal(rng.uniform(keys, counters, stream), together)  # all 200 as Python ints
        monkeypatch.setattr(rng, "SMALL", 0)
        assert torch.equal(rng.uniform(keys[:8], counters[:8], stream), together[:8])  # 8 through tensors
        monkeypatch.undo()


def test_a_request_for_more_samples_than_max_batch_size_runs_in_parts(qwen2):
    """Regression: n=300 with max_batch_size=256 was refused. The request's samples are queued in parts
    of at most max_batch_size; each sample depends only on its seed and index, so nothing changes."""
    _, model = qwen2
    prompts = prompts_of([5, 8])
    params = [tlt.SamplingParams(n=n, temperature=1.0, max_tokens=10, seed=i, ignore_eos=True) for i, n in enumerate([5, 2])]
    free = tlt.RolloutEngine(model).generate(prompts, params)
    engine = tlt.RolloutEngine(model, config=tlt.EngineConfig(max_batch_size=2))
    parts = engine.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in parts] == [[c.token_ids for c in o.outputs] for o in free]
    assert [len(o.outputs) for o in parts] == [5, 2] and max(engine.stats()["batch_sizes"]) == 2
    with pytest.raises(tlt.ConfigError, match=r"needs 46 KV tokens \(2 samples admitted together"):
        tlt.RolloutEngine(model, config=tlt.EngineConfig(max_batch_size=2, kv_budget_tokens=40)).generate(
            prompts[1:], tlt.SamplingParams(n=3, max_tokens=15))


@pytest.mark.parametrize("fields, message", [
    (dict(n=True), "'n' must be an integer"),
    (dict(max_tokens=10.0), "'max_tokens' must be an integer"),
    (dict(temperature=float("inf")), "'temperature' must be a finite number"),
    (dict(temperature="0.7"), "'temperature' must be a finite number"),
    (dict(top_p=float("nan")), "'top_p' must be a number in"),
    (dict(stop_token_ids=5), "'stop_token_ids' must be a list of token ids"),
    (dict(stop_token_ids=[5.7]), "'stop_token_ids' must be token ids"),
    (dict(seed=-1), "'seed' must be None or an integer in"),
    (dict(seed=2.5), "'seed' must be None or an integer in"),
    (dict(ignore_eos="false"), "'ignore_eos' must be true or false"),
])
def test_sampling_params_refuse_what_they_would_reinterpret(fields, message):
    """Regression: a float stop id was truncated (5.7 -> 5), the string "false" turned ignore_eos on, an
    infinite temperature sampled uniformly, and a whole float or a bool passed as a count."""
    with pytest.raises(tlt.ConfigError, match=message):
        tlt.SamplingParams(**fields)
    import numpy as np

    params = tlt.SamplingParams(n=np.int64(2), seed=np.uint64(7), stop_token_ids=[np.int32(3)])
    assert (params.n, params.seed, params.stop_token_ids) == (2, 7, (3,)) and type(params.seed) is int


def test_generate_refuses_prompts_it_would_reinterpret(qwen2):
    """Regression: a single string was read as one prompt per character, and float token ids were
    truncated to ints."""
    _, model = qwen2
    engine = tlt.RolloutEngine(model, CharTokenizer())
    params = tlt.SamplingParams(max_tokens=2, seed=0)
    for prompts, message in [("Q:1+2\nA:", "prompts is one string"), ([5, 6, 7], "flat list of token ids"),
                             ([[5, 6.5, 7]], "prompt 0 must hold integer token ids, got 6.5"),
                             ([torch.tensor([5.0, 6.0])], "prompt 0 must be a 1-D integer tensor")]:
        with pytest.raises(tlt.ConfigError, match=message):
            engine.generate(prompts, params)
    with pytest.raises(tlt.ConfigError, match=r"params\[1\] must be a SamplingParams, got dict"):
        engine.generate([[5], [6]], [params, {"max_tokens": 2}])
    ids = engine.generate([torch.tensor([5, 6, 7]), np.array([5, 6, 7])], params)
    assert ids[0].outputs[0].token_ids == ids[1].outputs[0].token_ids


@pytest.mark.parametrize("fields, message", [
    (dict(max_batch_size=2.5), "'max_batch_size' must be an integer >= 1"),
    (dict(kv_budget_tokens=0), "'kv_budget_tokens' must be an integer >= 1 or None"),
    (dict(max_draft_tokens=0), "'max_draft_tokens' must be an integer >= 1"),
    (dict(seed=1.5), "'seed' must be an integer or None"),
    (dict(progress="no"), "'progress' must be true, false or None"),
    (dict(speculative="on", strategy="tree-d3-k2-v4"), "'tree-d3-k2-v4' needs a drafter"),
])
def test_engine_config_refuses_what_would_fail_later(fields, message):
    """Regression: a tree strategy without a drafter failed when the engine was built, with a ValueError
    that the command line printed as a traceback; max_draft_tokens was not checked at all."""
    with pytest.raises(tlt.ConfigError, match=message):
        tlt.EngineConfig(**fields)


def test_prefill_chunks_minimise_padded_slots_plus_a_cost_per_forward():
    from tlt.rollout.batch import prefill_chunks

    def cost(lengths, chunks, overhead):
        return sum(overhead + len(c) * max(lengths[i] for i in c) for c in chunks)

    bench = [78, 32, 10, 24, 22, 28, 16, 48, 18, 10, 10, 356, 334, 56, 30, 298]  # the bench task's prompts
    some = bench[5:]
    order = sorted(range(len(some)), key=lambda i: some[i])
    splits = [[order[a:b] for a, b in zip((0,) + cuts, cuts + (len(some),))]
              for k in range(len(some)) for cuts in itertools.combinations(range(1, len(some)), k)]
    for overhead in (0, 32, 10**6):
        chunks = prefill_chunks(some, overhead)
        assert sorted(i for c in chunks for i in c) == list(range(len(some)))
        assert all(c == sorted(c) for c in chunks)  # a chunk's rows keep the prompts' order
        assert cost(some, chunks, overhead) == min(cost(some, split, overhead) for split in splits)  # 1,024 of them
    assert len(prefill_chunks(bench, 10**6)) == 1 and len(prefill_chunks(bench, 0)) == 14  # 14 distinct lengths
    assert [[bench[i] for i in c] for c in prefill_chunks(bench, 32)][-1] == [356, 334]
    assert prefill_chunks([], 32) == [] and prefill_chunks([5, 5, 5], 0) == [[0, 1, 2]]
