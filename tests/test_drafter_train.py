"""Offline drafter training: pairing, loss, packing, unrolling, the frozen target, persistence, CLI."""

import json

import pytest
import torch

from tlt.config import build
from tlt.errors import ConfigError
from tlt.model import ModelConfig, Transformer
from tlt.speculative.drafter import Drafter
from tlt.speculative.data import DraftRecord, collect, fill_rows, pack, record_pairs, records_from_texts
from tlt.speculative.train import (DrafterTrainConfig, acceptance_top1, eagle_loss, held_out_acceptance, train_drafter,
                                   unrolled_loss)

QUIET = dict(log=lambda line: None)


def small_config(**overrides):
    fields = dict(steps=20, lr=3e-3, warmup_steps=5, batch_tokens=128, rows=2, window=32, log_every=10)
    fields.update(overrides)
    return DrafterTrainConfig(**fields)


def bigram_target(V=16, H=32, sharpness=2.0, seed=0):
    """A deterministic toy target whose most likely next token is perm[current token]: its decoder
    layer is the identity (zero output projections), embeddings are orthonormal and the LM head maps
    each token's feature to its successor. Sampled at temperature 1 the argmax has probability ~1/3,
    so the token a feature produced is not predictable from the feature alone."""
    torch.manual_seed(seed)
    config = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=V, hidden_size=H, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=256, qk_norm=True, tie_word_embeddings=False)
    model = Transformer(config).eval()
    with torch.no_grad():
        E = torch.linalg.qr(torch.randn(H, V))[0].T  # [V, H], orthonormal rows
        model.model.embed_tokens.weight.copy_(E)
        for name, p in model.model.layers.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()
        perm = torch.randperm(V)
        head = torch.zeros(V, H)
        head[perm] = E * sharpness / H**0.5  # RMSNorm scales a unit row to norm sqrt(H)
        model.lm_head.weight.copy_(head)
    return model, perm


@pytest.fixture
def target(tiny_model):
    return tiny_model(seed=3)


@pytest.fixture
def records(target):
    return collect(target, None, [[1, 5, 7], [1, 9], [1, 4, 4, 8, 3]], samples_per_prompt=2, temperature=1.0,
                   max_tokens=24, seed=0)


def test_pairs_match_a_full_target_forward(target, records):
    """Pair i is (h_i, y_i) at t = prompt_len + i - 1 -> h_{i+1}: checked against the features of one
    target forward over prompt + response, including that neighbouring positions do not match."""
    prompts = {3: [1, 5, 7], 2: [1, 9], 5: [1, 4, 4, 8, 3]}
    assert len(records) == 6
    for r in records:
        P, n = r.prompt_len, len(r.tokens)
        ids = torch.tensor(prompts[P] + r.tokens.tolist())[None]
        with torch.no_grad():
            out = target(ids)
        hidden = out.hidden_states[0]  # [P + n, H]
        p = record_pairs(r)
        assert len(p) == n - 1
        for i in range(n - 1):
            t = P + i - 1
            assert p.positions[i] == t
            assert p.tokens[i] == ids[0, t + 1]  # the token the feature at t produced
            torch.testing.assert_close(p.inputs[i], hidden[t], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(p.targets[i], hidden[t + 1], atol=1e-4, rtol=1e-4)
            assert not torch.allclose(p.inputs[i], hidden[t + 1], atol=1e-3)  # off by one the other way
            assert not torch.allclose(p.targets[i], hidden[t], atol=1e-3)
            # the target distribution predicts y_{i+1}
            assert torch.equal(target.lm_head(p.targets[i]).argmax(), out.logits[0, t + 1].argmax())
        last = record_pairs(r, window=3)
        assert torch.equal(last.tokens, p.tokens[-3:]) and torch.equal(last.positions, p.positions[-3:])
    # A target forward over the same text gives the same records as the engine's decode features.
    again = records_from_texts(target, None, [prompts[r.prompt_len] for r in records],
                               [r.tokens.tolist() for r in records])
    for a, b in zip(records, again):
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        torch.testing.assert_close(a.features, b.features, atol=1e-4, rtol=1e-4)


def test_drafter_learns_the_next_token_of_a_bigram_target():
    """With the right pairing the drafter sees the token its input feature produced, which decides the
    target's next argmax; paired with the token before it, it could only guess (about 1/3)."""
    model, perm = bigram_target()
    train = collect(model, None, [[1, 2, 3]] * 16, samples_per_prompt=4, temperature=1.0, max_tokens=48, seed=0)
    held_out = collect(model, None, [[4, 5]] * 8, samples_per_prompt=2, temperature=1.0, max_tokens=48, seed=1)
    p = record_pairs(train[0])
    assert torch.equal(model.lm_head(p.targets).argmax(-1), perm[p.tokens])
    fresh = Drafter.from_target(model, seed=0)
    before = acceptance_top1(fresh, held_out)
    drafter, metrics = train_drafter(model, train, small_config(steps=120, batch_tokens=256, window=64), fresh, **QUIET)
    after = acceptance_top1(drafter, held_out)
    assert before < 0.3 and after > 0.95, (before, after)
    assert metrics["feature_loss"] < 0.05 and metrics["token_kl"] < 0.05


def test_held_out_acceptance_is_paired_and_rises_with_training():
    """The held-out acceptance of `tlt train-drafter` runs a target-only tree on the very samples
    `collect` draws for the same prompts and seeds, so before and after are measured on one set of
    responses; a drafter that learned the bigram target's successor is accepted more often."""
    model, _ = bigram_target()
    train = collect(model, None, [[1, 2, 3]] * 16, samples_per_prompt=4, temperature=1.0, max_tokens=48, seed=0)
    prompts = [[4, 5], [6], [7, 8, 9]]
    held_out = collect(model, None, prompts, samples_per_prompt=2, temperature=1.0, max_tokens=40, seed=1)
    fresh = Drafter.from_target(model, seed=0)
    before, before_ids = held_out_acceptance(fresh, None, prompts, 2, 1.0, 40, seed=1)
    drafter, _ = train_drafter(model, train, small_config(steps=120, batch_tokens=256, window=64),
                               Drafter.from_target(model, seed=0), **QUIET)
    after, after_ids = held_out_acceptance(drafter, None, prompts, 2, 1.0, 40, seed=1)
    assert before_ids == after_ids == [r.tokens.tolist() for r in held_out]
    assert 1.0 <= before < after <= 5.0 and after > before + 0.2, (before, after)
    with pytest.raises(ConfigError, match="target-only"):
        held_out_acceptance(drafter, None, prompts, 2, 1.0, 40, seed=1, strategy="chain-d4")


def test_eagle_loss_is_zero_at_the_optimum_and_positive_elsewhere():
    torch.manual_seed(0)
    f = torch.randn(2, 5, 8)
    logits = torch.randn(2, 5, 11)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    # Equal outputs: no feature loss, the token term is the target's entropy, so KL 0, top-1 1.
    loss, m = eagle_loss(f, f, logits, logits, mask)
    assert m["feature_loss"] == 0 and m["token_kl"] == pytest.approx(0, abs=1e-6) and m["top1"] == 1
    p = logits.softmax(-1)
    entropy = -(p * p.log()).sum(-1)[mask].mean()
    assert loss.item() == pytest.approx(0.1 * entropy.item(), rel=1e-5)
    # A one-hot target distribution has no entropy: the whole loss is 0.
    peaked = torch.nn.functional.one_hot(logits.argmax(-1), 11).float() * 1e4
    assert eagle_loss(f, f, peaked, peaked, mask)[0].item() == pytest.approx(0, abs=1e-6)
    # Anything else costs, and masked positions never count.
    other = eagle_loss(f + 0.3, f, logits.flip(-1), logits, mask)[0]
    assert other > loss
    junk = f.clone()
    junk[0, 3:] = 100
    assert eagle_loss(junk, f, logits, logits, mask)[0].item() == pytest.approx(loss.item())


def test_training_leaves_the_target_untouched(target, records):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter, _ = train_drafter(target, records, small_config(steps=5), **QUIET)
    for name, p in target.named_parameters():
        assert p.grad is None, name
        assert torch.equal(p, before[name]), name
    assert all(p.grad is not None for p in drafter.parameters())
    assert not any(p is q for p in drafter.parameters() for q in target.parameters())


def test_packing_equals_each_record_alone(target, records):
    """Windows packed in one row with positions restarting at 0 give the same outputs and loss as each
    window alone at its true positions (RoPE is relative; the mask is block-diagonal)."""
    drafter = Drafter.from_target(target, seed=1)
    pairs = [record_pairs(r, window=8) for r in records[:3]]
    L = sum(len(p) for p in pairs) + 3
    packed = pack([pairs], L)
    assert packed.mask.sum() == L - 3 and (packed.positions == 0).sum() == 3
    c = small_config()
    with torch.no_grad():
        f_hat, logits = drafter(packed.tokens, packed.inputs, packed.positions, attention_mask=packed.mask)
        total, _ = unrolled_loss(drafter, packed, c)
        weighted, offset = 0.0, 0
        for p in pairs:
            f_alone, logits_alone = drafter(p.tokens[None], p.inputs[None], p.positions[None])
            torch.testing.assert_close(f_hat[0, offset : offset + len(p)], f_alone[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[0, offset : offset + len(p)], logits_alone[0], atol=1e-5, rtol=1e-5)
            alone, _ = unrolled_loss(drafter, pack([[p]], len(p)), c)
            weighted += alone.item() * len(p)
            offset += len(p)
    assert total.item() == pytest.approx(weighted / offset, rel=1e-5)
    rows = list(fill_rows(iter(pairs), 10))
    assert all(sum(len(p) for p in row) <= 10 for row in rows) and sum(map(len, rows)) == 3


def test_unroll_two_trains_on_its_own_features(target, records):
    c = small_config(steps=120, unroll=2)
    drafter = Drafter.from_target(target, seed=0)
    batch = pack(list(fill_rows(iter([record_pairs(r, c.window) for r in records]), c.row_tokens)), c.row_tokens)
    with torch.no_grad():
        start, m0 = unrolled_loss(drafter, batch, c)
    drafter, metrics = train_drafter(target, records, c, drafter, **QUIET)
    with torch.no_grad():
        end, m1 = unrolled_loss(drafter, batch, c)
    assert "top1@2" in m0 and "top1@2" in metrics
    assert end < 0.7 * start, (start.item(), end.item())


def test_eagle3_drafter_trains_on_fused_layers(target):
    drafter = Drafter.from_target(target, feature_layers=(0, 1), seed=0)
    prompts = [[1, 5, 7], [1, 9]]
    recs = collect(target, None, prompts, samples_per_prompt=2, max_tokens=16, seed=0,
                   output_layers=drafter.output_layers)
    r = recs[0]
    with torch.no_grad():
        out = target(torch.tensor(prompts[0] + r.tokens.tolist())[None], output_layers=(0, 1))
    span = slice(r.prompt_len - 1, r.prompt_len - 1 + len(r.tokens))
    torch.testing.assert_close(r.layers[:, 1], out.layer_states[1][0, span])
    torch.testing.assert_close(r.features, out.hidden_states[0, span])
    fuse = drafter.fuse.weight.clone()
    drafter, _ = train_drafter(target, recs, small_config(steps=3), drafter, **QUIET)
    assert not torch.equal(fuse, drafter.fuse.weight)
    plain = collect(target, None, prompts, samples_per_prompt=1, max_tokens=8, seed=0)
    with pytest.raises(ConfigError, match="output_layers"):
        train_drafter(target, plain, small_config(steps=1), drafter, **QUIET)


def test_trained_drafter_round_trips_through_save_and_load(target, records, tmp_path):
    drafter, _ = train_drafter(target, records, small_config(steps=5), **QUIET)
    drafter.save(tmp_path)
    loaded = Drafter.load(tmp_path, target)
    assert loaded.config == drafter.config
    batch = pack(list(fill_rows(iter([record_pairs(r) for r in records]), 64)), 64)
    with torch.no_grad():
        a = drafter(batch.tokens, batch.inputs, batch.positions, attention_mask=batch.mask)
        b = loaded(batch.tokens, batch.inputs, batch.positions, attention_mask=batch.mask)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert acceptance_top1(loaded, records) == acceptance_top1(drafter, records)


def test_a_drafter_records_the_longest_window_it_was_trained_over(target, records):
    longest = max(len(r.tokens) - 1 for r in records)  # the pairs of the longest record
    assert 8 < longest <= 23
    drafter, _ = train_drafter(target, records, small_config(steps=1, window=8), **QUIET)
    assert drafter.config.train_window == 8  # records cut to their last 8 pairs
    drafter, _ = train_drafter(target, records, small_config(steps=1, window=32), drafter, **QUIET)
    assert drafter.config.train_window == longest  # no record reached 32 pairs
    drafter, _ = train_drafter(target, records, small_config(steps=1, window=8), drafter, **QUIET)
    assert drafter.config.train_window == longest  # a continued drafter keeps the longer


def test_config_validates_itself():
    with pytest.raises(ConfigError, match="window"):
        DrafterTrainConfig(batch_tokens=1024, rows=4, window=512)
    with pytest.raises(ConfigError, match="unknown"):
        build(DrafterTrainConfig, overrides=["windows=3"])
    assert build(DrafterTrainConfig, overrides=["feature_layers=0,3", "unroll=2"]).feature_layers == (0, 3)
    with pytest.raises(ConfigError, match="fewer than 2"):
        train_drafter(bigram_target()[0], [DraftRecord(torch.tensor([3]), torch.zeros(1, 32), 2)],
                      small_config(), **QUIET)


def test_cli_writes_a_loadable_drafter_and_its_recipe(tiny_model, tmp_path):
    from tlt.cli import main
    from tlt.tasks import ArithmeticTask, CharTokenizer

    tokenizer = CharTokenizer()
    model = tiny_model(seed=0, vocab_size=32, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    problem = ArithmeticTask().problem(47, [("+", 8), ("-", 3)])
    (text,) = records_from_texts(model, tokenizer, [problem.prompt], [problem.solution])
    assert text.prompt_len == len(tokenizer.encode(problem.prompt))
    assert text.tokens.tolist() == tokenizer.encode(problem.solution, add_special_tokens=False) + [2]
    out = tmp_path / "drafter"
    rc = main(["train-drafter", "--model", str(tmp_path / "model"), "--out", str(out), "--prompts", "4",
               "--samples", "2", "--max-tokens", "12", "--eval-prompts", "2",
               "steps=3", "batch_tokens=64", "rows=2", "window=16", "log_every=1"])
    assert rc == 0
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["config"]["steps"] == 3 and recipe["metrics"]["step"] == 3
    assert "held_out_top1" in recipe["metrics"] and recipe["command"].startswith("tlt ")
    metrics = recipe["metrics"]
    assert metrics["held_out_strategy"] == "tree-d4-k2-v8"
    assert 1.0 <= metrics["held_out_acceptance_before"] <= 5.0 and 1.0 <= metrics["held_out_acceptance"] <= 5.0
    from tlt.model import load_model

    Drafter.load(out, load_model(tmp_path / "model"))
