"""Speculative decoding is lossless: greedy token for token, sampling in distribution (chi-square over
every 3-token continuation of a tiny-vocabulary target), log-probs and features as a full forward."""

import itertools

import pytest
import torch

import tlt
from tlt.model import ModelConfig, Transformer
from tlt.rollout.sampling import warp_logprobs
from tlt.speculative import Drafter, Strategy

from random_weights import randomize_

STRATEGIES = ["chain-d3", "tree-d4-k3-v10", "ngram-d4", "tree-d4-k3-v10-p30"]


def random_target(vocab=61, seed=0, scale=0.3):
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=vocab, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=256, qk_norm=True, eos_token_id=1,
    )).eval()
    return randomize_(model, scale)


class AdversarialDrafter(Drafter):
    """Proposes the token the target finds least likely: its logits are the target's, negated."""

    def forward(self, tokens, features, position_ids, cache=None, tree_mask=None, attention_mask=None):
        f_hat, _ = super().forward(tokens, features, position_ids, cache, tree_mask, attention_mask)
        return f_hat, -self.target.lm_head(features)


def trained_drafter(target, prompt):
    """A drafter trained briefly on the target's own samples, so its proposals are often right."""
    from tlt.speculative.data import collect
    from tlt.speculative.train import DrafterTrainConfig, train_drafter

    records = collect(target, None, [prompt] * 8, samples_per_prompt=8, temperature=1.0, max_tokens=24, seed=0)
    config = DrafterTrainConfig(steps=60, lr=3e-3, warmup_steps=5, batch_tokens=256, rows=4, window=32, log_every=1000)
    drafter, _ = train_drafter(target, records, config, log=lambda line: None)
    return drafter.eval()


def drafters_for(target, prompt=None):
    out = {"random": Drafter.from_target(target, seed=1), "adversarial": AdversarialDrafter(target),
           "fused": Drafter.from_target(target, feature_layers=(0, 1), seed=2)}  # EAGLE-3 style features
    if prompt is not None:
        out["trained"] = trained_drafter(target, prompt)
    return out


def tokens_of(outputs):
    return [c.token_ids for o in outputs for c in o.outputs]


def engine(target, strategy, drafter=None, **config):
    return tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="on", strategy=strategy, drafter=drafter,
                                                             **config))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["trained", "random", "adversarial", "fused"])
def test_greedy_speculative_equals_plain(strategy, kind):
    target = random_target()
    prompts = [torch.randint(3, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11, 7)]
    drafter = drafters_for(target, prompts[0] if kind == "trained" else None)[kind]
    params = tlt.SamplingParams(n=2, temperature=0, max_tokens=48, ignore_eos=True)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    spec = engine(target, strategy, drafter)
    outputs = spec.generate(prompts, params)
    assert tokens_of(outputs) == tokens_of(plain)
    assert spec.stats()["acceptance_length"] >= 1.0
    assert all(c.acceptance_length >= 1.0 for o in outputs for c in o.outputs)  # per sequence too


@pytest.mark.parametrize("strategy", ["chain-d3", "tree-d4-k3-v10"])
def test_greedy_speculative_equals_plain_in_bf16(strategy):
    """bf16 rollouts (tlt's kernels and a bf16 KV cache, or oneDNN weights and a float32 one): verifying 4-10 tokens in one forward
    picks the same greedy tokens as decoding them one by one."""
    target = random_target(scale=0.6).bfloat16()
    prompts = [torch.randint(3, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11, 7)]
    params = tlt.SamplingParams(n=2, temperature=0, max_tokens=48, ignore_eos=True)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    spec = engine(target, strategy, Drafter.from_target(target, seed=1))
    assert tokens_of(spec.generate(prompts, params)) == tokens_of(plain)
    assert target.model.layers[0]._fused.value is not None


def test_greedy_accepts_long_runs_when_drafts_are_right():
    """Greedy decoding of a random target falls into a cycle, which the n-gram drafter then predicts
    exactly: whole drafts must be accepted (the compaction of many accepted nodes is exercised) and
    the output must still equal plain decoding."""
    target = random_target(seed=2)
    params = tlt.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    plain = tlt.RolloutEngine(target).generate([[5, 6, 7, 8]], params)
    spec = engine(target, "ngram-d6")
    assert tokens_of(spec.generate([[5, 6, 7, 8]], params)) == tokens_of(plain)
    assert spec.stats()["acceptance_length"] >= 4.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_logprobs_and_features_equal_full_forward(strategy):
    target = random_target(seed=3)
    prompt = [3, 9, 27, 4, 5]
    params = tlt.SamplingParams(n=3, temperature=0.9, top_p=0.95, top_k=30, max_tokens=30, seed=1,
                                ignore_eos=True, return_hidden_states=True)
    out = engine(target, strategy, Drafter.from_target(target, seed=2)).generate([prompt], params)[0]
    for c in out.outputs:
        with torch.no_grad():
            full = target(torch.tensor([prompt + c.token_ids]))
        logits = full.logits[0, len(prompt) - 1 : -1]
        n = len(c.token_ids)
        warped = warp_logprobs(logits, torch.full((n,), 0.9), torch.full((n,), 30), torch.full((n,), 0.95))
        ref = warped.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert (torch.tensor(c.logprobs) - ref).abs().max() <= 1e-4
        assert (c.hidden_states - full.hidden_states[0, len(prompt) - 1 : -1]).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["tree-d4-k3-v10", "ngram-d4", "tree-d4-k3-v10-p20"])
def test_target_only_verification_reproduces_plain_sampling(strategy, dtype):
    """Tree and n-gram verification draw each token with the uniform plain decoding uses at that
    position, so with the same seed the samples are the same, token for token (bf16 too: tlt's kernels
    and a bf16 KV cache)."""
    target = random_target(seed=4).to(dtype)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5]]
    params = tlt.SamplingParams(n=4, temperature=1.0, max_tokens=30, seed=11, ignore_eos=True)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    spec = engine(target, strategy, Drafter.from_target(target, seed=5)).generate(prompts, params)
    assert tokens_of(spec) == tokens_of(plain)


def test_same_seed_same_output_under_speculation_whatever_shares_the_batch():
    target = random_target(seed=6)
    drafter = Drafter.from_target(target, seed=7)
    params = tlt.SamplingParams(n=2, temperature=1.0, max_tokens=25, seed=99, ignore_eos=True)
    alone = engine(target, "chain-d3", drafter).generate([[4, 5, 6]], params)
    mixed = engine(target, "chain-d3", drafter).generate(
        [[7, 8], [4, 5, 6], [9, 9, 9, 9]], [tlt.SamplingParams(max_tokens=40), params, tlt.SamplingParams(n=3)]
    )
    assert tokens_of(alone) == [c.token_ids for c in mixed[1].outputs]


# --- exact distribution ----------------------------------------------------------------------------

VOCAB = 8


def exact_three_token_distribution(target, prompt, temperature, top_k, top_p) -> torch.Tensor:
    """P(x1, x2, x3) over all VOCAB^3 continuations, from full forwards under the same warping."""
    seqs = torch.tensor([prompt + list(c) for c in itertools.product(range(VOCAB), repeat=3)])
    with torch.no_grad():
        logits = target(seqs).logits[:, len(prompt) - 1 : len(prompt) + 2]  # [V^3, 3, V]
    n = logits.shape[0] * 3
    lp = warp_logprobs(logits.reshape(n, VOCAB), torch.full((n,), temperature), torch.full((n,), top_k),
                       torch.full((n,), top_p)).view(-1, 3, VOCAB)
    picked = lp.gather(2, seqs[:, len(prompt):, None])[..., 0]  # [V^3, 3]
    return picked.sum(1).double().exp()


def sample_counts(target, drafter, strategy, prompt, temperature, top_k, top_p, n, seed):
    spec = engine(target, strategy, drafter, max_batch_size=n)
    params = tlt.SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3, seed=seed,
                                ignore_eos=True)
    seqs = torch.tensor([c.token_ids for c in spec.generate([prompt], params)[0].outputs])
    index = (seqs * torch.tensor([VOCAB * VOCAB, VOCAB, 1])).sum(1)
    return torch.bincount(index, minlength=VOCAB**3), spec


def chi_square_pvalue(counts, probs):
    from scipy.stats import chisquare

    assert int(counts[probs == 0].sum()) == 0, "a continuation with zero probability was sampled"
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), (exp[keep] * obs.sum() / exp[keep].sum()).numpy()).pvalue)


SETTINGS = [
    # (drafter, strategy, temperature, top_k, top_p)
    ("trained", "tree-d3-k2-v5", 0.6, -1, 1.0),
    ("trained", "chain-d3", 1.0, 5, 0.8),
    ("random", "chain-d3", 0.6, -1, 1.0),
    ("adversarial", "chain-d3", 1.3, -1, 1.0),
    ("adversarial", "tree-d3-k2-v5", 1.0, -1, 0.8),
    ("random", "tree-d3-k3-v6", 1.3, 5, 1.0),
    ("random", "ngram-d3", 1.0, 5, 0.8),
    ("trained", "tree-d3-k2-v5-p40", 1.0, -1, 1.0),  # pruned: rows verify 0 to 5 nodes
]


@pytest.mark.parametrize("kind,strategy,temperature,top_k,top_p", SETTINGS)
def test_sampling_is_exact(kind, strategy, temperature, top_k, top_p):
    target = random_target(vocab=VOCAB, seed=8, scale=0.6)
    prompt = list(range(VOCAB)) * 2  # every token has a continuation for the n-gram drafter
    drafter = drafters_for(target, prompt if kind == "trained" else None)[kind]
    counts, spec = sample_counts(target, drafter, strategy, prompt, temperature, top_k, top_p, 50_000, seed=1)
    probs = exact_three_token_distribution(target, prompt, temperature, top_k, top_p)
    assert chi_square_pvalue(counts, probs) > 0.001
    if kind != "adversarial":  # the adversarial drafter's proposals are mostly (top-p: all) rejected
        assert spec.stats()["acceptance_length"] > 1.0  # drafts were really accepted, not just rejected


def float32_kernel(monkeypatch, on: bool) -> None:
    """Every float32 product on prepacked weights (forced: the tiny weights are below the size where packing is
    chosen): tlt's float32 kernel with `on`, oneDNN's without."""
    import tlt.model.packed as packed
    from tlt.model import cpu_f32

    if not packed.ONEDNN:
        pytest.skip("this PyTorch build has no oneDNN")
    if on and cpu_f32.kernels() is None:
        pytest.skip("tlt's float32 CPU kernel does not run here")
    monkeypatch.setattr(packed, "PACK_MIN_BYTES", 0)
    monkeypatch.setattr(packed, "F32_KERNEL", on)


@pytest.mark.parametrize("on", [False, True], ids=["onednn", "float32 kernel"])
@pytest.mark.parametrize("kind,strategy,temperature,top_k,top_p", [SETTINGS[0], SETTINGS[3]])
def test_sampling_is_exact_on_prepacked_weights(monkeypatch, kind, strategy, temperature, top_k, top_p, on):
    """The chi-square test with every product of target and drafter on prepacked weights."""
    float32_kernel(monkeypatch, on)
    test_sampling_is_exact(kind, strategy, temperature, top_k, top_p)
    qkv = random_target(vocab=VOCAB).model.layers[0].fused_weights().qkv
    assert qkv.packed and (qkv.f32_kernel is not None) == on


@pytest.mark.parametrize("strategy", ["chain-d3", "tree-d4-k3-v10", "ngram-d4"])
def test_speculative_equals_plain_on_the_float32_kernel(monkeypatch, strategy):
    """With every product on tlt's float32 kernel (as a large model's on a CPU without AVX-512), greedy and seeded
    speculative decoding (target-only arms) give plain decoding's tokens."""
    float32_kernel(monkeypatch, True)
    target = random_target(seed=4, scale=0.6)
    prompts = [torch.randint(3, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11, 7)]
    drafter = Drafter.from_target(target, seed=5)
    settings = [tlt.SamplingParams(n=2, temperature=0, max_tokens=48, ignore_eos=True)]
    if strategy != "chain-d3":  # chains with speculative sampling keep the distribution, not the samples
        settings.append(tlt.SamplingParams(n=4, temperature=1.0, max_tokens=30, seed=11, ignore_eos=True))
    for params in settings:
        plain = tlt.RolloutEngine(target).generate(prompts, params)
        spec = engine(target, strategy, drafter)
        assert tokens_of(spec.generate(prompts, params)) == tokens_of(plain)
        assert spec.stats()["acceptance_length"] > 1.0  # drafts were verified and some accepted
    assert target.model.layers[0].fused_weights().qkv.f32_kernel is not None


def test_chi_square_catches_a_biased_verifier(monkeypatch):
    """Guards the exactness tests: a verifier that accepts every sampled draft must fail them."""
    import tlt.speculative.decoder as decoder

    def accept_all(p, q, draft, u_accept, u_final):
        k = draft.shape[1]
        count = torch.full((draft.shape[0],), k, dtype=torch.long)
        return count, p[:, k].argmax(-1)

    monkeypatch.setattr(decoder, "speculative_sample_chain", accept_all)
    target = random_target(vocab=VOCAB, seed=8, scale=0.6)
    prompt = [1, 2, 3, 2, 1, 2]
    counts, _ = sample_counts(target, drafters_for(target)["random"], "chain-d3", prompt, 1.0, -1, 1.0, 20_000, 1)
    assert chi_square_pvalue(counts, exact_three_token_distribution(target, prompt, 1.0, -1, 1.0)) < 1e-6


def test_strategy_names_round_trip_and_validation():
    for name in ("off", "chain-d4", "ngram-d6", "tree-d6-k4-v24", "tree-d4-k2-v8-p20"):
        assert Strategy.parse(name).name == name
    assert Strategy.parse("tree-d4-k2-v8-p20").prune == 20 and Strategy.parse("tree-d4-k2-v8").prune == 0
    for bad in ("chain-d4-p20", "ngram-d4-p20", "tree-d4-k2-v8-p100"):
        with pytest.raises(tlt.ConfigError, match="prune"):
            Strategy.parse(bad)
    # only verify.walk's strategies draw with plain sampling's uniforms whatever the drafts
    assert [Strategy.parse(n).target_only for n in ("off", "chain-d4", "ngram-d6", "tree-d6-k4-v24")] == [
        False, False, True, True]
    with pytest.raises(tlt.ConfigError):
        Strategy.parse("tree-x3")
    with pytest.raises(tlt.ConfigError):
        Strategy(kind="beam")
    # paths deeper than the CPU attention keeps bit for bit (hybrid rows take suffix paths verify_tokens deep)
    assert Strategy.parse("suffix-d63-v64").depth == 63
    for deep in ("tree-d64-k1-v64", "suffix-d64-v64", "hybrid-d4-k4-v64"):
        with pytest.raises(tlt.ConfigError, match="must be <= 63"):
            Strategy.parse(deep)
    with pytest.raises(ValueError, match="needs a drafter"):
        engine(random_target(), "tree-d3-k2-v4")


def test_pruned_tree_keeps_the_nodes_above_the_floor_with_their_ancestors():
    from tlt.speculative.tree import _select

    # pool: level 1 nodes 0 and 1 (from the root), level 2 nodes 2 (child of 0) and 3 (child of 1)
    tokens = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    parents = torch.tensor([[-1, -1, 0, 1]] * 3)
    depth = torch.tensor([[1, 1, 2, 2]] * 3)
    scores = torch.tensor([[-0.1, -2.0, -0.3, -2.5],  # p 0.90, 0.14, 0.74, 0.08
                           [-3.0, -4.0, -5.0, -6.0],  # none above one half
                           [-0.2, -0.4, -0.6, -0.5]])  # all, but verify_tokens keeps three
    root = torch.tensor([1, 2, 3])
    draft = _select(tokens, parents, scores, depth, root, Strategy.parse("tree-d2-k2-v3-p50"), None)
    assert draft.valid.tolist() == [[True, True, True, False], [True, False, False, False], [True] * 4]
    assert draft.tokens[0, :3].tolist() == [1, 10, 12] and draft.parents[0].tolist() == [-1, 0, 1, -2]
    assert draft.parents[1].tolist() == [-1, -2, -2, -2] and draft.depth[1].tolist() == [0, 0, 0, 0]
    assert draft.tokens[2].tolist() == [3, 30, 31, 33] and draft.parents[2].tolist() == [-1, 0, 0, 2]
    assert draft.depth[0].tolist() == [0, 1, 2, 0] and draft.depth[2].tolist() == [0, 1, 1, 2]
    # unpruned, every row keeps verify_tokens nodes
    full = _select(tokens, parents, scores, depth, root, Strategy.parse("tree-d2-k2-v3"), None)
    assert bool(full.valid.all()) and full.tokens.shape == (3, 4)
    # a floor no node reaches leaves the roots alone: a plain step's one token a row
    none = _select(tokens, parents, scores - 10, depth, root, Strategy.parse("tree-d2-k2-v3-p50"), None)
    assert none.tokens.tolist() == [[1], [2], [3]] and none.parents.tolist() == [[-1]] * 3


def test_pruned_tree_verifies_fewer_tokens_than_the_full_one(monkeypatch):
    from tlt.speculative.decoder import SpeculativeDecoder

    real_verify = SpeculativeDecoder._verify
    verified = []  # real draft tokens (roots included) of each verification

    def counting(self, batch, draft):
        verified.append(int(draft.valid.sum()))
        return real_verify(self, batch, draft)

    monkeypatch.setattr(SpeculativeDecoder, "_verify", counting)
    target = random_target(seed=6)
    drafter = Drafter.from_target(target, seed=7)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5]]
    params = tlt.SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=2, ignore_eos=True)
    runs = {}
    for name in ("tree-d4-k3-v10", "tree-d4-k3-v10-p20"):
        verified.clear()
        out = engine(target, name, drafter).generate(prompts, params)
        runs[name] = (sum(verified) / len(verified), tokens_of(out))
    assert runs["tree-d4-k3-v10-p20"][1] == runs["tree-d4-k3-v10"][1]  # target-only: the same samples
    assert runs["tree-d4-k3-v10-p20"][0] < runs["tree-d4-k3-v10"][0]


def test_pruned_tree_stops_expanding_where_no_row_can_keep_a_deeper_node(monkeypatch):
    """A level whose frontier is under the floor in every row ends the expansion: the drafts verified are
    those of the full expansion, node for node, with fewer drafter calls."""
    import tlt.speculative.tree as tree
    from tlt.speculative.decoder import SpeculativeDecoder

    real_verify, real_below = SpeculativeDecoder._verify, tree.below_floor
    drafts, stops = [], []

    def recording(self, batch, draft):
        drafts.append([(t[v].tolist(), p[v].tolist()) for t, p, v in zip(draft.tokens, draft.parents, draft.valid)])
        return real_verify(self, batch, draft)

    def counted(frontier_score, strategy):
        stops.append(real_below(frontier_score, strategy))
        return stops[-1]

    monkeypatch.setattr(SpeculativeDecoder, "_verify", recording)
    target = random_target(seed=6)
    drafter = Drafter.from_target(target, seed=7)
    params = tlt.SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=2, ignore_eos=True)
    runs = []
    for below in (counted, lambda frontier_score, strategy: False):  # early stop, then the full expansion
        monkeypatch.setattr(tree, "below_floor", below)
        drafts.clear()
        out = engine(target, "tree-d6-k2-v10-p30", drafter).generate([[3, 4, 5], [9, 8, 7, 6, 5]], params)
        runs.append((list(drafts), tokens_of(out)))
    assert runs[0] == runs[1]
    assert any(stops)  # the random drafter's paths fall under 30% within six levels


def test_drafter_save_load_and_target_check(tmp_path):
    target = random_target()
    drafter = Drafter.from_target(target, seed=3)
    drafter.save(tmp_path)
    loaded = Drafter.load(tmp_path, target)
    tokens, feats, pos = torch.randint(0, 61, (2, 5)), torch.randn(2, 5, 32), torch.arange(5).expand(2, 5)
    with torch.no_grad():
        assert torch.equal(drafter(tokens, feats, pos)[1], loaded(tokens, feats, pos)[1])
    assert not any(k.startswith(("embed", "lm_head")) for k in drafter.trainable_state())
    with pytest.raises(tlt.CheckpointError, match="vocab_size"):
        Drafter.load(tmp_path, random_target(vocab=50))


@pytest.mark.parametrize("strategy", ["tree-d4-k3-v10", "chain-d3"])
def test_continuous_batching_under_speculation(strategy):
    """Requests admitted while others are mid-draft join the drafter's state (DraftState.extend) too."""
    target = random_target(seed=15)
    drafter = Drafter.from_target(target, seed=4)
    prompts = [[3, 4], [5, 6, 7, 8], [9], [10, 11, 12], [13, 14, 15, 16, 17]]
    params = [tlt.SamplingParams(n=2, temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 6, 18, 3, 25)]
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    spec = engine(target, strategy, drafter, max_batch_size=3)
    assert tokens_of(spec.generate(prompts, params)) == tokens_of(plain)
    assert max(spec.stats()["batch_sizes"]) <= 3


@pytest.mark.parametrize("strategy", ["chain-d3", "tree-d4-k3-v10", "off"])
def test_returned_layer_states_equal_a_full_forwards(strategy):
    """With an EAGLE-3 drafter the engine also returns the outputs of the target layers it reads, for every
    generated token, from the decode and verify forwards it ran anyway (what online training needs)."""
    target = random_target(seed=7)
    drafter = Drafter.from_target(target, feature_layers=(0, 1), seed=2)
    prompt = [3, 9, 27, 4, 5]
    params = tlt.SamplingParams(n=2, temperature=1.0, max_tokens=30, seed=4, ignore_eos=True, return_hidden_states=True)
    config = tlt.EngineConfig(speculative="adaptive", drafter=drafter) if strategy == "off" else \
        tlt.EngineConfig(speculative="on", strategy=strategy, drafter=drafter)
    out = tlt.RolloutEngine(target, config=config).generate([prompt], params)[0]
    for c in out.outputs:
        with torch.no_grad():
            full = target(torch.tensor([prompt + c.token_ids]), output_layers=(0, 1))
        span = slice(len(prompt) - 1, len(prompt) - 1 + len(c.token_ids))
        assert c.layer_states.shape == (len(c.token_ids), 2, 32)
        for j, layer in enumerate((0, 1)):
            assert (c.layer_states[:, j] - full.layer_states[layer][0, span]).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["off", "tree-d4-k3-v10"])
def test_rows_filling_finished_places_from_the_tail_change_no_sample(monkeypatch, strategy, dtype):
    """When responses end, the engine moves the batch's last rows into their places instead of shifting
    every row behind them: the samples are those of an order-keeping drop, token for token, under plain
    decoding and target-only tree verification, in float32 and on tlt's bf16 kernels."""
    import tlt.rollout.engine as engine_module

    target = random_target(seed=8).to(dtype)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5], [11, 12]]
    params = [tlt.SamplingParams(n=3, temperature=1.0, max_tokens=m, seed=i, ignore_eos=True)
              for i, m in enumerate([9, 30, 17])]  # staggered ends: rows die in the middle of the batch

    def run():
        if strategy == "off":
            return tokens_of(tlt.RolloutEngine(target).generate(prompts, params))
        return tokens_of(engine(target, strategy, Drafter.from_target(target, seed=9)).generate(prompts, params))

    filled = run()
    moves = []
    original = engine_module.fill_from_tail
    monkeypatch.setattr(engine_module, "fill_from_tail", lambda alive: moves.append(original(alive)) or
                        [b for b, a in enumerate(alive) if a])  # the order-keeping drop
    assert run() == filled
    assert any(keep != sorted(keep) for keep in moves)  # the tail did move into earlier places


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["off", "tree-d4-k3-v10"])
def test_prompts_prefilled_in_chunks_of_similar_lengths_change_no_sample(monkeypatch, strategy, dtype):
    """Prompts of very different lengths are prefilled in several chunks (`prefill_chunks`): the samples
    are those of one right-padded forward over all of them, token for token, under plain decoding and
    target-only tree verification, in float32 and on tlt's bf16 kernels."""
    import tlt.rollout.engine as engine_module

    target = random_target(seed=5).to(dtype)
    prompts = [[7] * 90, [3, 4, 5], [9, 8, 7, 6, 5] * 16, [11, 12], [1 + i % 50 for i in range(40)]]
    params = [tlt.SamplingParams(n=2, temperature=1.0, max_tokens=m, seed=i, ignore_eos=True)
              for i, m in enumerate([12, 20, 6, 15, 9])]

    def run():
        if strategy == "off":
            return tokens_of(tlt.RolloutEngine(target).generate(prompts, params))
        return tokens_of(engine(target, strategy, Drafter.from_target(target, seed=3)).generate(prompts, params))

    chunks = []
    original = engine_module.prefill_chunks
    monkeypatch.setattr(engine_module, "prefill_chunks", lambda lengths: chunks.append(original(lengths)) or chunks[-1])
    chunked = run()
    assert [[len(prompts[i]) for i in c] for c in chunks[0]] == [[3, 2], [40], [90, 80]]
    monkeypatch.setattr(engine_module, "prefill_chunks", lambda lengths: [list(range(len(lengths)))])
    assert run() == chunked
