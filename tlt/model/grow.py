"""Grow a trained model into a larger shape that computes the same function (function-preserving growth).

The larger model starts as the trained one plus capacity that contributes nothing yet, so training it
further starts from the small model's accuracy instead of from scratch (the bench policy's recipe,
`tlt sft --preset bench`, grows the default model this way: ~100 M parameters cannot learn the task
from scratch within an hour on 2 cores). Growth along each axis:

  - width: the small model's residual stream occupies the first `hidden` dimensions of the new one,
    the others start at 0 (embedding columns, rows of every product that writes the residual: o, down).
    Each RMSNorm over the wider stream divides by an rms sqrt(H_new / H_old) times smaller, which the
    norm's weight absorbs (scaled by sqrt(H_old / H_new)) and the eps too (the grown config's
    `rms_norm_eps` is the old one times H_old / H_new; the per-head q/k norms, over an unchanged
    head size, see that smaller eps: the only inexact part, ~1e-6 of the logits);
  - heads: the small model's query heads and key/value heads come first, with the same group size so
    every old query head reads its old kv head; o's columns for the new heads start at 0;
  - MLP: the old intermediate units come first; down's columns for new units start at 0;
  - depth: new layers sit between old ones, evenly spread, with o and down at 0: each is the identity.

Everything else (new rows and columns read from the stream, new layers' q/k/v/gate/up, norms) keeps
the fresh model's initialisation, so gradients reach the new capacity from the first step. Head size,
vocabulary, RoPE, q/k-norm, biases and embedding tying must agree between the two shapes.
"""

from __future__ import annotations

import math

import torch

from tlt.errors import ConfigError
from tlt.model.config import ModelConfig
from tlt.model.transformer import Transformer

SAME_FIELDS = ("vocab_size", "head_dim", "rope_theta", "rope_scaling", "qk_norm", "qkv_bias", "o_bias",
               "mlp_bias", "tie_word_embeddings")
AT_LEAST_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                   "num_hidden_layers")


def check_growable(old: ModelConfig, new: ModelConfig) -> None:
    """Raise ConfigError naming the field when `old` cannot grow into `new`."""
    for name in SAME_FIELDS:
        if getattr(old, name) != getattr(new, name):
            raise ConfigError(f"cannot grow: field {name!r} must stay {getattr(old, name)!r}, got {getattr(new, name)!r}")
    for name in AT_LEAST_FIELDS:
        if getattr(new, name) < getattr(old, name):
            raise ConfigError(f"cannot grow: field {name!r} must be >= {getattr(old, name)}, got {getattr(new, name)}")
    old_group = old.num_attention_heads // old.num_key_value_heads
    new_group = new.num_attention_heads // new.num_key_value_heads
    if old_group != new_group:
        raise ConfigError(f"cannot grow: query heads per kv head must stay {old_group} "
                          f"(num_attention_heads / num_key_value_heads), got {new_group}")


def layer_slots(old_layers: int, new_layers: int) -> list[int]:
    """The new index of each old layer: old layers keep their order, new ones spread between them."""
    return [round(i * new_layers / old_layers) for i in range(old_layers)]


@torch.no_grad()
def grow(small: Transformer, config: ModelConfig, seed: int = 0) -> Transformer:
    """A float32 model of `config` (its `rms_norm_eps` replaced) whose forward equals `small`'s (module
    docstring)."""
    check_growable(small.config, config)
    config = config.replace(rms_norm_eps=small.config.rms_norm_eps * small.config.hidden_size / config.hidden_size)
    torch.manual_seed(seed)
    big = Transformer(config)
    old, H_old, H_new = small.config, small.config.hidden_size, config.hidden_size
    q_old, kv_old = old.num_attention_heads * old.head_dim, old.num_key_value_heads * old.head_dim
    I_old = old.intermediate_size
    norm_scale = math.sqrt(H_old / H_new)

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst[tuple(slice(0, n) for n in src.shape)] = src.float()

    def norm(dst, src) -> None:
        dst.weight.fill_(float(src.weight.float().mean()) * norm_scale)
        dst.weight[:H_old] = src.weight.float() * norm_scale

    big.model.embed_tokens.weight[:, H_old:] = 0
    put(big.model.embed_tokens.weight, small.model.embed_tokens.weight)
    if not config.tie_word_embeddings:
        big.lm_head.weight[:, H_old:] = 0
        put(big.lm_head.weight, small.lm_head.weight)
    norm(big.model.norm, small.model.norm)
    slots = layer_slots(old.num_hidden_layers, config.num_hidden_layers)
    for i, layer in enumerate(big.model.layers):
        a, mlp = layer.self_attn, layer.mlp
        a.o_proj.weight.zero_()
        mlp.down_proj.weight.zero_()
        for m in (a.o_proj, mlp.down_proj):
            if m.bias is not None:
                m.bias.zero_()
        if i not in slots:
            continue  # a new layer: the identity until trained
        s = small.model.layers[slots.index(i)]
        sa, smlp = s.self_attn, s.mlp
        norm(layer.input_layernorm, s.input_layernorm)
        norm(layer.post_attention_layernorm, s.post_attention_layernorm)
        for name, rows in (("q_proj", q_old), ("k_proj", kv_old), ("v_proj", kv_old)):
            put(getattr(a, name).weight, getattr(sa, name).weight)
            if getattr(sa, name).bias is not None:
                getattr(a, name).bias[:rows] = getattr(sa, name).bias.float()
        put(a.o_proj.weight, sa.o_proj.weight)
        if old.qk_norm:
            a.q_norm.weight.copy_(sa.q_norm.weight.float())
            a.k_norm.weight.copy_(sa.k_norm.weight.float())
        for name in ("gate_proj", "up_proj"):
            put(getattr(mlp, name).weight, getattr(smlp, name).weight)
            if getattr(smlp, name).bias is not None:
                getattr(mlp, name).bias[:I_old] = getattr(smlp, name).bias.float()
        put(mlp.down_proj.weight, smlp.down_proj.weight)
        for m, sm in ((a.o_proj, sa.o_proj), (mlp.down_proj, smlp.down_proj)):
            if sm.bias is not None:
                m.bias[:H_old] = sm.bias.float()
    return big
