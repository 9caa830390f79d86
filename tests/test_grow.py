"""Function-preserving growth (tlt/model/grow.py): the grown model computes what the small one does, in
training and cached forwards, and its new capacity trains."""

from __future__ import annotations

import json

import pytest
import torch

from tlt.errors import ConfigError
from tlt.model.grow import grow, layer_slots

BIGGER = dict(hidden_size=96, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=160)


@pytest.mark.parametrize("overrides", [
    {},  # Qwen3: q/k norms, untied
    {"architecture": "Qwen2ForCausalLM", "qk_norm": False, "qkv_bias": True, "tie_word_embeddings": True},
    {"architecture": "LlamaForCausalLM", "qk_norm": False, "o_bias": True, "mlp_bias": True},
], ids=["qwen3", "qwen2-tied", "llama-biases"])
def test_grown_model_computes_the_small_models_logits(tiny_model, overrides):
    small = tiny_model(**overrides).double()
    big = grow(small, small.config.replace(**BIGGER)).double().eval()
    assert sum(p.numel() for p in big.parameters()) > 3 * sum(p.numel() for p in small.parameters())
    ids = torch.randint(small.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    # training forward (gradients on: the reference layers) on packed rows
    pos = torch.cat([torch.arange(12), torch.arange(18)]).expand(2, -1)
    want, got = small(ids, position_ids=pos).logits.detach(), big(ids, position_ids=pos).logits.detach()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # cached decode (no gradients: the fused step), prompt then one token at a time
    with torch.inference_mode():
        ca, cb = small.new_cache(2), big.new_cache(2)
        outs = [(small(ids[:, :20], cache=ca).logits, big(ids[:, :20], cache=cb).logits)]
        outs += [(small(ids[:, t:t + 1], cache=ca).logits, big(ids[:, t:t + 1], cache=cb).logits) for t in range(20, 30)]
    for want, got in outs:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_new_capacity_is_zero_where_it_writes_and_trains_from_the_first_step(tiny_model):
    small = tiny_model()
    big = grow(small, small.config.replace(**BIGGER)).train()
    slots = layer_slots(small.config.num_hidden_layers, BIGGER["num_hidden_layers"])
    new_layer = next(i for i in range(BIGGER["num_hidden_layers"]) if i not in slots)
    down = big.model.layers[new_layer].mlp.down_proj.weight
    assert not down.any() and not big.model.embed_tokens.weight[:, 48:].any()
    ids = torch.randint(small.config.vocab_size, (2, 16))
    logits = big(ids).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    torch.optim.SGD(big.parameters(), lr=0.1).step()
    assert down.any() and big.model.embed_tokens.weight[:, 48:].any()


def test_layer_slots_keep_order_and_spread_new_layers():
    assert layer_slots(8, 12) == [0, 2, 3, 4, 6, 8, 9, 10]
    assert layer_slots(3, 3) == [0, 1, 2]
    for old, new in ((2, 5), (8, 12), (7, 30)):
        slots = layer_slots(old, new)
        assert slots == sorted(set(slots)) and slots[-1] < new


@pytest.mark.parametrize("change, match", [
    ({"head_dim": 16, "hidden_size": 96}, "head_dim"),
    ({"num_attention_heads": 8, "num_key_value_heads": 2}, "query heads per kv head"),
    ({"hidden_size": 24}, "hidden_size"),
    ({"num_hidden_layers": 1}, "num_hidden_layers"),
    ({"qk_norm": False}, "qk_norm"),
    ({"vocab_size": 70}, "vocab_size"),
])
def test_shapes_that_cannot_grow_name_the_field(tiny_model, change, match):
    small = tiny_model()
    with pytest.raises(ConfigError, match=match):
        grow(small, small.config.replace(**change))


def test_sft_with_init_starts_from_the_grown_model(tmp_path):
    from tlt.model.checkpoint import load_model
    from tlt.sft import SFTConfig, train_sft

    shape = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024)
    small_c = SFTConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=48, steps=3, warmup_steps=1,
                        threads=1, log_every=1, save_every=3, **shape)
    train_sft(small_c, tmp_path / "small", log=lambda _: None)
    big_c = SFTConfig(hidden_size=64, num_hidden_layers=3, intermediate_size=96, steps=1, warmup_steps=1,
                      lr=1e-9, threads=1, log_every=1, save_every=1, init=str(tmp_path / "small"), **shape)
    lines = []
    train_sft(big_c, tmp_path / "big", log=lines.append)
    big = load_model(tmp_path / "big")
    assert (big.config.hidden_size, big.config.num_hidden_layers) == (64, 3)
    assert big.config.rms_norm_eps == pytest.approx(0.5e-6)  # scaled by old / new width
    assert json.loads((tmp_path / "big" / "recipe.json").read_text())["config"]["init"] == str(tmp_path / "small")
    # at a vanishing learning rate the saved model still computes the small one's function
    small = load_model(tmp_path / "small")
    ids = torch.randint(3, 32, (1, 40))
    with torch.no_grad():
        want, got = small(ids).logits, big(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
