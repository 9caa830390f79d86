"""The decoder layer's inference step on fused weights: the same function with fewer operators.

A decode step of a small model is bound by the count of operators, not by arithmetic: on a 2-core CPU
every PyTorch operator costs 5-20 us whatever its size. A reference layer's one-token step of the
default model dispatches 254 ATen operators (RMSNorm alone about seven; counted with the profiler) in
1.3 ms. Without gradients the layer instead runs on weights prepared once:

  - the input norm's weight is folded into the q/k/v product, whose three weights are stacked into one:
    q|k|v = (x * r) @ (W_qkv * w_in)^T, r = rsqrt(mean(x^2) + eps) [one product instead of three];
  - q and k, adjacent in that output, share one per-head norm (their two weights stacked) and one RoPE
    rotation;
  - the post-attention norm's weight is folded into the stacked gate|up product likewise;
  - the o and down products add the residual inside the matrix product (addmm).

146 ATen operators, 0.75 ms (1.7x faster; 9 tokens 1.6x, 17 tokens 1.5x; medians of 3 alternating
rounds, 2 threads).
Whole forwards of the default model, reference over fused: 64 rows x 1 token 1.21x, 128 x 1 1.05x,
32 x 9 1.13x, 16 x 17 1.09x, 4 x 128 1.10x, but 8 x 128 0.95x and 64 x 128 0.91x (the stacked gate|up
product and the strided q/k slices cost more than the calls they save once the products dominate):
forwards of more than MAX_ROWS tokens take the reference layer. The result equals the reference layer
up to float32 rounding (about 1e-6, the products and the norm multiply in another order), so it is
used for float32 only: half precision keeps the reference layer, whose order of rounding
transformers' layers share. Training (gradients on) always runs the reference layer on the
parameters themselves.

The prepared weights are a second copy of the stacked q/k/v and gate/up weights (about two thirds of
a layer's), held once the model has decoded in float32. They are rebuilt when any parameter of the
layer changes: they are keyed by each parameter's storage and version counter, which every in-place
update bumps (optimizer steps, `load_state_dict`, `copy_` under `torch.no_grad()`), as does moving or
casting the module or assigning a new parameter. A write through `param.data` bypasses the counter
and is not seen (update weights in place under `torch.no_grad()` instead), nor is a submodule
replaced by another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tlt.model.attention import attend
from tlt.model.layout import laid_out
from tlt.model.rope import apply_rope


MAX_ROWS = 512  # tokens per forward (rows x new tokens) up to which the fused step is the faster


def uses_fused_step(x: torch.Tensor) -> bool:
    """Whether a layer forward on hidden states `x` [B, T, hidden] runs the fused step: float32 without
    gradients, at most MAX_ROWS tokens."""
    return x.dtype == torch.float32 and not torch.is_grad_enabled() and x.shape[0] * x.shape[1] <= MAX_ROWS


def _stack_bias(*linears: nn.Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


@dataclass
class FusedWeights:
    key: tuple  # (storage, version) of every parameter the weights were built from
    heads: int
    kv_heads: int
    head_dim: int
    input_eps: float | None  # None: the input norm is the identity (a drafter's layer)
    qk_eps: float
    post_eps: float
    qkv: torch.Tensor  # [(H + 2 H_kv) D, hidden], the input norm's weight folded in
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [H + H_kv, D]: q_norm's weight per query head, then k_norm's per kv head
    o_t: torch.Tensor  # [H D, hidden]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 I, hidden], the post-attention norm's weight folded in
    gate_up_bias: torch.Tensor | None
    down_t: torch.Tensor  # [I, hidden]
    down_bias: torch.Tensor | None

    @staticmethod
    def key_of(tables: list[dict]) -> tuple:
        """The key of the parameters in `tables`, the `_parameters` dicts of a layer's modules (read
        directly: `Module.parameters()` costs 60 us a call, as much as the operators saved)."""
        return tuple((p.data_ptr(), p._version) for table in tables for p in table.values() if p is not None)

    @classmethod
    def build(cls, layer: nn.Module, key: tuple) -> "FusedWeights":
        a, mlp, norm_in, norm_post = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        identity = isinstance(norm_in, nn.Identity)
        with torch.no_grad():
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            if not identity:
                qkv = qkv * norm_in.weight
            qk_norm = None
            if a.qk_norm:
                qk_norm = torch.cat([a.q_norm.weight.expand(a.heads, a.head_dim),
                                     a.k_norm.weight.expand(a.kv_heads, a.head_dim)])
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]) * norm_post.weight
            return cls(key, a.heads, a.kv_heads, a.head_dim, None if identity else norm_in.eps,
                       a.q_norm.eps if a.qk_norm else 0.0, norm_post.eps,
                       laid_out(qkv), _stack_bias(a.q_proj, a.k_proj, a.v_proj), qk_norm,
                       a.o_proj.weight.t(), a.o_proj.bias, laid_out(gate_up),
                       _stack_bias(mlp.gate_proj, mlp.up_proj), mlp.down_proj.weight.t(), mlp.down_proj.bias)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) over the last dim, keeping it: [..., 1]."""
    return torch.mean(x * x, -1, keepdim=True).add_(eps).rsqrt_()


def _add_product(residual: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """residual + x @ w_t (+ bias), all [N, *] 2-D."""
    out = torch.addmm(residual, x, w_t)
    return out if bias is None else out.add_(bias)


def fused_layer_step(fused: FusedWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     mask: torch.Tensor | None, cache, index: int) -> torch.Tensor:
    """`DecoderLayer.forward` (same arguments, same result up to rounding) on the layer's `fused`
    weights; x [B, T, hidden]."""
    H, Hkv, D = fused.heads, fused.kv_heads, fused.head_dim
    B, T, hidden = x.shape
    x2 = x.reshape(B * T, hidden)
    normed = x2 if fused.input_eps is None else x2 * _rms(x2, fused.input_eps)
    qkv = F.linear(normed, fused.qkv, fused.qkv_bias).view(B, T, H + 2 * Hkv, D)
    qk = qkv[:, :, : H + Hkv]  # [B, T, H + H_kv, D]
    if fused.qk_norm is not None:
        qk = qk * _rms(qk, fused.qk_eps) * fused.qk_norm
    qk = apply_rope(qk, cos, sin).transpose(1, 2)  # [B, H + H_kv, T, D]
    q, k = qk[:, :H], qk[:, H:]
    v = qkv[:, :, H + Hkv :].transpose(1, 2)  # [B, H_kv, T, D]
    if cache is not None:
        k, v = cache.write(index, k, v)  # [B, H_kv, S, D]
    out = attend(q, k, v, mask).transpose(1, 2).reshape(B * T, H * D)
    x2 = _add_product(x2, out, fused.o_t, fused.o_bias)
    gate_up = F.linear(x2 * _rms(x2, fused.post_eps), fused.gate_up, fused.gate_up_bias)  # [B T, 2 I]
    inter = gate_up.shape[1] // 2
    x2 = _add_product(x2, F.silu(gate_up[:, :inter]) * gate_up[:, inter:], fused.down_t, fused.down_bias)
    return x2.view(B, T, hidden)
