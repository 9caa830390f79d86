"""One decoder implementation for every Llama-family checkpoint (Llama, Qwen2, Qwen3).

Pre-norm decoder layers: RMSNorm -> grouped-query attention with RoPE (optional q/k/v bias, optional
per-head q/k RMSNorm) -> residual -> RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and the LM head
(tied to the embedding or not). Parameter names are those of transformers' state dicts, so checkpoints
load and save without a name map.

`forward` has two modes sharing every line of math but the attention mask:
  - training (`cache=None`): causal attention over `input_ids` [B, T]; `attention_mask` [B, T] marks real
    tokens (left or right padding); explicit `position_ids` where a 0 starts a new sequence give packed
    rows with no attention across sequence boundaries.
  - cached (`cache` given): `input_ids` [B, T] are new tokens appended after each row's cached ones;
    they attend to the cache plus, among themselves, what `tree_mask` [T, T] or [B, T, T] allows
    (causal when None: a tree draft passes its ancestor matrix). A `tree_mask` of width D + T also
    masks the last D cached tokens (a drafter expanding a tree level by level). `attention_mask` [B, T] marks real new
    tokens, right-padded (a batch of prompts of different lengths prefilled at once, drafts of different sizes);
    on tlt's CPU kernels the layers then run on the real tokens only (`Transformer._packed`).
Both return `ModelOutput`: logits (optionally only at `logit_index`), the last-layer hidden states after
the final norm (the feature f of EAGLE drafters: lm_head(f) gives the logits) and, on request, the outputs
of chosen intermediate layers (EAGLE-3 style low/mid/high features).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tlt.model.attention import attend
from tlt.model.config import ModelConfig
from tlt.model.fused import FusedWeights, fused_layer_step, on_layer_step, parameters_of, uses_fused_step
from tlt.model.kv_cache import KVCache, mask_dtype
from tlt.model.layout import ColumnMajorLinears, column_major_linears
from tlt.model.packed import Prepared, inference_linear
from tlt.model.rope import RopeTables, apply_rope, inverse_frequencies


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V], or [B, K, V] when logit_index was given
    hidden_states: torch.Tensor  # [B, T, H], after the final norm
    layer_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> [B, T, H]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op, bit for bit the reference formula below in fp32.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 but apply the weight in the input dtype, as the reference implementation
        # does, so bf16 models agree with it.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.qk_norm = c.qk_norm

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, H, T, D]
        k = apply_rope(k, cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
        if cache is not None:
            k, v = cache.write(layer, k, v)  # [B, Hkv, S, D]
        # mask None: every key is visible but the new tokens' later ones (see `attention_mask_for`).
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """`input_norm=False` makes input_layernorm the identity (no weight), as in the EAGLE-1 drafter's
    layer, whose attention reads fc's output as it is."""

    def __init__(self, c: ModelConfig, input_norm: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        self._fused = Prepared()  # FusedWeights
        self._tables = [m._parameters for m in self.modules()]  # what the fused weights are keyed by
        self.weight_bits = 16  # of the fused weights: 4 rounds them (a drafter's, FusedWeights.build)

    def fused_weights(self) -> FusedWeights:
        """The weights of the fused inference step (tlt/model/fused.py), rebuilt when a parameter changed."""
        return self._fused.get(parameters_of(self._tables), lambda: FusedWeights.build(self, self.weight_bits))

    def set_weight_bits(self, bits: int) -> None:
        """Fused weights of 16 bits (the parameters' values) or rounded to 4 (a drafter's, where tlt's CPU
        kernels take them); rebuilt at the next inference step."""
        if bits not in (4, 16):
            raise ValueError(f"bits must be 4 or 16, got {bits!r}")
        self.weight_bits, self._fused = bits, Prepared()

    def _kernel_step_at_any_size(self, x, cos, mask, cache) -> bool:
        """Whether a cached float32 forward past the fused step's MAX_ROWS tokens runs this layer on tlt's float32
        kernel's layer step all the same (its products all take the kernel): a verification of many rows then gets,
        token for token, the bits plain decoding's one-token steps get on it, where the reference layer's products and
        attention would round otherwise (as bf16 on tlt's kernels does at any size, `uses_fused_step`)."""
        if cache is None or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled() \
                or torch.is_autocast_enabled("cpu"):
            return False
        return on_layer_step(self.fused_weights(), cache, mask, cos)

    def forward(self, x, cos, sin, mask, cache, layer, counts: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden]; with `counts` [B] the packed tokens [N, hidden] of `fused_layer_step` (the
        model packs only where `on_layer_step` holds)."""
        if counts is not None or uses_fused_step(x) or self._kernel_step_at_any_size(x, cos, mask, cache):
            return fused_layer_step(self.fused_weights(), x, cos, sin, mask, cache, layer, counts)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def training_mask(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, B: int, T: int, device):
    """Boolean mask [B, 1, T, T]: causal, no padded keys, no attention across packed sequences."""
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None].expand(B, T, T)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    if position_ids is not None:
        segment = torch.cumsum((position_ids == 0).long(), dim=1)  # [B, T]
        allowed = allowed & (segment[:, :, None] == segment[:, None, :])
    # Every query may see itself, so fully padded query rows stay finite (their outputs are ignored).
    return (allowed | torch.eye(T, dtype=torch.bool, device=device))[:, None]


def cached_mask(lengths: torch.Tensor, tree: torch.Tensor, valid: torch.Tensor, S: int) -> torch.Tensor:
    """Boolean mask [B, 1, T, S] for T new tokens after `lengths` [B] cached ones, keys in slots 0..S-1.
    tree: [B, T, D + T], what each new token may see among the last D cached tokens of its row (draft
    tokens written by earlier steps of a tree expansion) and the T new ones; all earlier cached tokens
    are visible. valid: [B, T] real (unpadded) new tokens."""
    B, T = valid.shape
    D = tree.shape[-1] - T
    rel = torch.arange(S, device=lengths.device)[None, :] - (lengths - D)[:, None]  # [B, S] slot - draft start
    in_tree = (rel >= 0) & (rel < D + T)  # [B, S]
    idx = rel.clamp(0, D + T - 1)  # [B, S]
    seen = torch.gather(tree, 2, idx[:, None, :].expand(B, T, S))  # [B, T, S]
    key_valid = torch.cat([torch.ones(B, D, dtype=torch.bool, device=valid.device), valid], 1)  # [B, D + T]
    seen = seen & torch.gather(key_valid, 1, idx)[:, None, :] & in_tree[:, None, :]
    itself = rel[:, None, :] == (D + torch.arange(T, device=lengths.device))[None, :, None]  # [B, T, S]
    return ((rel < 0)[:, None, :] | seen | itself)[:, None]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask as the additive float mask attention uses, built once per forward rather
    than converted again in every layer."""
    return torch.full(allowed.shape, float("-inf"), dtype=dtype, device=allowed.device).masked_fill_(allowed, 0.0)


def attention_mask_for(cache: KVCache, T: int, tree_mask: torch.Tensor | None, attention_mask: torch.Tensor | None,
                       dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask [B, 1, T, S] of T new tokens written after the rows of `cache` (S = its longest
    row + T), for a cached forward's `tree_mask` and `attention_mask` (see the module docstring); None
    when attention needs no mask: a causal prefill into an empty cache, or one new token per row on
    rows of equal length."""
    B, lo, hi = cache.batch_size, cache.min_length, cache.max_length
    device = cache.device
    if tree_mask is None and attention_mask is None and (hi == 0 or (T == 1 and lo == hi)):
        return None
    tree = torch.ones(T, T, dtype=torch.bool, device=device).tril() if tree_mask is None else tree_mask.bool()
    kernels = cache.mask_kernels() if dtype == torch.float32 else None
    if kernels is not None:  # the same mask in one pass of tlt's CPU kernels (a drafter call's: 0.03 ms, by operators 0.23-0.34)
        valid = None if attention_mask is None else attention_mask.bool()
        return kernels.tree_mask(cache.lengths, tree if tree.dim() == 3 else tree[None], valid, hi + T)
    if lo != hi:
        tree = tree.expand(B, *tree.shape) if tree.dim() == 2 else tree
        valid = torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
        return additive(cached_mask(cache.lengths, tree, valid, hi + T), dtype)
    # Rows of equal length n: slots before the D trailing draft slots are visible to all, so only the
    # last D + T columns depend on the tree; this is cached_mask's result built directly.
    D = tree.shape[-1] - T
    allowed = tree  # [B or 1, T, D + T]
    if attention_mask is not None:
        keys = torch.cat([torch.ones(B, D, dtype=torch.bool, device=device), attention_mask.bool()], 1)  # [B, D + T]
        allowed = allowed & keys[:, None, :]
    mask = torch.zeros(B, 1, T, hi + T, dtype=dtype, device=device)
    tail = mask[..., hi - D :]  # [B, 1, T, D + T] a view
    tail.masked_fill_(~allowed.reshape(-1, 1, T, D + T), float("-inf"))
    tail.diagonal(D, -2, -1).fill_(0.0)  # every token sees itself
    return mask


def _unpacked(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Packed tokens [N, hidden] back at their places in [B, T, hidden] (zeros at the padding)."""
    out = x.new_zeros(*real.shape, x.shape[-1])
    out[real] = x
    return out


class OnLMHead:
    """`dtype` and `device` of a module, read off its LM head (a Transformer, or a drafter's view of one)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


class Transformer(ColumnMajorLinears, OnLMHead, nn.Module):
    """A Llama-family causal LM. See the module docstring for the two forward modes."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, scaling = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scaling_factor = scaling
        self.rope = RopeTables()
        self._head = Prepared()  # the LM head's PackedLinear
        self.apply(self._init)
        column_major_linears(self)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def new_cache(self, batch_size: int, **kwargs) -> KVCache:
        return KVCache.for_model(self, batch_size, **kwargs)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        tree_mask: torch.Tensor | None = None,
        logit_index: torch.Tensor | None = None,
        output_layers: Sequence[int] = (),
    ) -> ModelOutput:
        """logit_index [B, K]: positions whose logits to compute (all when None). output_layers: indices
        of decoder layers whose outputs (before the final norm) are returned in `layer_states`."""
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        B, T = x.shape[:2]
        device = x.device
        if cache is None:
            if position_ids is None and attention_mask is not None:
                position_ids_used = (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # [B, T]
            else:
                position_ids_used = position_ids
            if position_ids_used is None:
                position_ids_used = torch.arange(T, device=device)[None].expand(B, T)
            bound = T if position_ids is None else None  # derived positions are below T
            plain = attention_mask is None and (position_ids is None or not bool((position_ids[:, 1:] == 0).any()))
            mask = None if plain else additive(training_mask(attention_mask, position_ids, B, T, device), x.dtype)
        else:
            base = cache.lengths
            position_ids_used = base[:, None] + torch.arange(T, device=device) if position_ids is None else position_ids
            bound = cache.max_length + T if position_ids is None else None
            mask = attention_mask_for(cache, T, tree_mask, attention_mask, mask_dtype(cache.dtype, cache.device))
        cos, sin = self.rope(position_ids_used, self.inv_freq, self.rope_scaling_factor, x.dtype, bound)
        real = self._packed(x, cache, attention_mask, mask, cos)
        counts = None
        if real is not None:
            x, counts = x[real], real.sum(1)  # [N, hidden]: the real tokens only
        wanted = set(output_layers)
        layer_states = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, cache, i, counts)
            if i in wanted:
                layer_states[i] = x
        if real is not None:
            x = _unpacked(x, real)
            layer_states = {i: _unpacked(state, real) for i, state in layer_states.items()}
        if cache is not None:
            cache.advance(attention_mask.long().sum(1) if attention_mask is not None else T)
        hidden = self.model.norm(x)  # [B, T, H]
        picked = hidden if logit_index is None else torch.gather(
            hidden, 1, logit_index[..., None].expand(-1, -1, hidden.shape[-1])
        )
        return ModelOutput(self.head(picked), hidden, layer_states)

    def _packed(self, x, cache, attention_mask, mask, cos) -> torch.Tensor | None:
        """The real tokens [B, T] of a cached forward whose rows are right-padded (a batch of drafts of
        different sizes, of prompts of different lengths) when every layer runs the kernels' layer step:
        the layers then take only those tokens (`DecoderLayer.forward`'s counts), so padding costs no
        products. None otherwise: the layers take [B, T] as it is."""
        if cache is None or attention_mask is None or not uses_fused_step(x):
            return None
        real = attention_mask.bool()
        counts = real.sum(1)
        if int(counts.sum()) == real.numel():
            return None
        if not bool((real == (torch.arange(real.shape[1], device=real.device) < counts[:, None])).all()):
            return None  # padding inside a row: not the layer step's layout
        # The layers share their shapes, dtype and kind of prepared weights: the first answers for all (a layer
        # that did not run the layer step would refuse the packed tokens).
        if not on_layer_step(self.model.layers[0].fused_weights(), cache, mask, cos):
            return None
        return real

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits [..., V] of features [..., H] (on prepacked weights without gradients)."""
        return inference_linear(self._head, self.lm_head, hidden)

    def save_pretrained(self, directory, **kwargs) -> None:
        """Write config.json, generation_config.json and model.safetensors that transformers loads."""
        from tlt.model.checkpoint import save_pretrained

        save_pretrained(self, directory, **kwargs)
