"""The decoder layer's inference step on prepared weights: the same function with fewer operators.

A decode step of a small model is bound by the count of operators (on a 2-core CPU every PyTorch
operator costs 5-20 us whatever its size), one of a model larger than the last-level cache by the
bytes of weight it streams. Without gradients the layer runs on weights prepared once for both:

  - the input norm's weight is folded into the q/k/v product, whose three weights are stacked into one:
    q|k|v = rmsnorm(x) @ (W_qkv * w_in)^T [one product instead of three, one norm operator];
  - q and k, adjacent in that output, share one per-head norm (their two weights stacked) and one RoPE
    rotation;
  - the post-attention norm's weight is folded into the stacked gate|up product likewise;
  - the o and down products add the residual inside the matrix product;
  - every product runs through `PackedLinear` (tlt/model/packed.py): in bf16 on tlt's kernel
    (tlt/model/cpu_kernels.py), whose rms norm, q/k norm with RoPE and cache write, and attention over
    the cache then replace the operators (`F.rms_norm` 5-60 us a call, SDPA ~110 us at one
    token); prepacked oneDNN weights where the weight streams from memory (bf16 without the kernel where
    oneDNN packs bf16, large float32), except large float32 on a CPU without AVX-512, which takes tlt's
    AVX2 kernel (tlt/model/cpu_f32.py); MKL's column-major layout otherwise (PyTorch's plain bf16 products
    on an AVX2-only CPU);
  - where all four products and the attention run on the kernels, the whole layer is one call of them
    (`layer_step`): the ten Python-level calls it replaces cost 60-90 us a layer, 0.7-1 ms of a
    12-layer one-token step of ~9 ms. The same holds for a float32 model whose four products all take tlt's
    AVX2 kernel (a float32 cache in the usual layout): its `layer_step` runs the rms norms, the q/k norm with
    RoPE and the cache write, attention over the cache and silu * up beside the products (2 cores of a Zen 3
    EPYC, `tlt bench roofline --model random-large --dtype float32`: a one-token step 1.34x faster than with the
    operators below, a 9-token one 1.15x; docs/results/README.md).

On the default model (inside L3) a one-token step takes about half the time of the reference layer's.
Fusing cuts calls, not arithmetic: at 9-17 rows the products are bound by their arithmetic, so a
draft's verification there costs more than a one-token step (about 1.2-1.4x), and speculation gains
less than on a model whose step streams its weights (tlt/model/packed.py), where a few rows cost what
one does.
Forwards of more than MAX_ROWS tokens take the reference layer (except in bf16 on tlt's kernels),
whose separate products are the faster once the products dominate (the stacked gate|up and the
strided q/k slices cost more than the calls they save). In float32 the result equals the reference
layer up to rounding (about 1e-6: the products and the norm multiply in another order); in bf16 the
folded weights round once more, within bf16's tolerance of transformers' bf16 layers. On a GPU the fused step runs in float32 only
(half precision keeps the reference layer there). Training (gradients on) always runs the reference
layer on the parameters themselves.

The prepared weights are a second copy of the stacked q/k/v and gate/up weights (and, packed, of o and
down), held once the model has decoded. They are rebuilt when any parameter of the layer changes
(`Prepared` in tlt/model/packed.py: optimizer steps, `load_state_dict`, `copy_` under
`torch.no_grad()`, moving, casting, assigning a new parameter). A write through `param.data` bypasses
the version counter and is not seen (update weights in place under `torch.no_grad()` instead), nor is a
submodule replaced by another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tlt.model import cpu_kernels, packed
from tlt.model.attention import attend
from tlt.model.packed import PackedLinear
from tlt.model.rope import apply_rope


MAX_ROWS = 512  # tokens per forward (rows x new tokens) up to which the fused step is the faster


def uses_fused_step(x: torch.Tensor) -> bool:
    """Whether a layer forward on hidden states `x` [B, T, hidden] runs the fused step: without
    gradients, float32 up to MAX_ROWS tokens, bf16 on the CPU up to MAX_ROWS tokens or at any size on
    tlt's kernels (as fast as oneDNN's products at every row count, and the same rows bit for bit
    whatever the forward's size). Not under autocast: its products would take the prepared weights in
    their own dtype while autocast casts the operators between them (a bf16-autocast trainer's
    recomputed log-probs take the reference layer, as its update's forward does)."""
    if torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
        return False
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return x.shape[0] * x.shape[1] <= MAX_ROWS or (packed.KERNELS and cpu_kernels.kernels() is not None)
    return x.dtype == torch.float32 and x.shape[0] * x.shape[1] <= MAX_ROWS


def _stack_bias(*linears: nn.Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


def parameters_of(tables: list[dict]) -> list[torch.Tensor]:
    """The parameters in `tables`, `_parameters` dicts of modules (read directly: `Module.parameters()`
    costs 60 us a call, as much as the operators saved)."""
    return [p for table in tables for p in table.values() if p is not None]


@dataclass
class FusedWeights:
    heads: int
    kv_heads: int
    head_dim: int
    input_eps: float | None  # None: the input norm is the identity (a drafter's layer)
    qk_eps: float
    post_eps: float
    qkv: PackedLinear  # [(H + 2 H_kv) D, hidden], the input norm's weight folded in
    qk_norm: torch.Tensor | None  # [H + H_kv, D]: q_norm's weight per query head, then k_norm's per kv head
    qk_norm_f32: torch.Tensor | None  # the same in float32, as the kernels' rms norm reads it
    o: PackedLinear  # [hidden, H D]
    gate_up: PackedLinear  # [2 I, hidden], the post-attention norm's weight folded in
    down: PackedLinear  # [hidden, I]

    def __post_init__(self) -> None:
        # The four products as the kernels' layer_step takes them.
        products = (self.qkv, self.o, self.gate_up, self.down)
        self.weights = [p.weight for p in products]
        self.sizes = [p.out_features for p in products]
        self.biases = [p.bias for p in products]
        self.scales = [p.scales for p in products]
        # the module whose layer_step runs the whole layer: the kernel all four products take, if they take one
        self.step_kernel = self.qkv.kernel if all(p.kernel is self.qkv.kernel for p in products) else None

    @classmethod
    def build(cls, layer: nn.Module, bits: int = 16) -> "FusedWeights":
        """The layer's prepared weights; bits=4 rounds them to 4 bits where tlt's kernels take them
        (`PackedLinear`)."""
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
            return cls(a.heads, a.kv_heads, a.head_dim, None if identity else norm_in.eps,
                       a.q_norm.eps if a.qk_norm else 0.0, norm_post.eps,
                       PackedLinear(qkv, _stack_bias(a.q_proj, a.k_proj, a.v_proj), bits), qk_norm,
                       None if qk_norm is None else qk_norm.float().contiguous(),
                       PackedLinear(a.o_proj.weight, a.o_proj.bias, bits),
                       PackedLinear(gate_up, _stack_bias(mlp.gate_proj, mlp.up_proj), bits),
                       PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias, bits))


def _normed(x: torch.Tensor, eps: float, kernels=None) -> torch.Tensor:
    """x [N, C] / rms(x) over the last dim, in x's dtype (bf16 is normalised in float32), on the kernels'
    rms norm when given (`_norms`)."""
    if kernels is not None:
        return kernels.rms_norm(x[None], None, eps)[0]
    return F.rms_norm(x, x.shape[-1:], None, eps)


def _norms(fused: FusedWeights):
    """The kernels whose rms norm the layer's operator path takes: tlt's bf16 kernels, or its float32 kernel where
    the products run on it (F.rms_norm's operators cost 50-95 us a call there, these a few), else None."""
    return fused.qkv.kernel


def _qk_normed(fused: FusedWeights, qk: torch.Tensor) -> torch.Tensor:
    """The per-head q/k norm of qk [B, T, H + H_kv, D] with its weights."""
    kernels = _norms(fused)
    if kernels is None:
        return F.rms_norm(qk, qk.shape[-1:], None, fused.qk_eps) * fused.qk_norm
    B, T, heads, D = qk.shape
    return kernels.rms_norm(qk.reshape(B * T, heads, D), fused.qk_norm_f32, fused.qk_eps).view(B, T, heads, D)


def on_layer_step(fused: FusedWeights, cache, mask: torch.Tensor | None, cos: torch.Tensor) -> bool:
    """Whether `fused_layer_step` runs the whole layer in one call of the kernels, the step that also takes packed
    tokens: cached forwards of a bf16 model on tlt's bf16 kernels, or of a float32 one (float32 cache in the usual
    layout) on its float32 kernel."""
    kernel = fused.step_kernel
    if kernel is None or cache is None or (mask is not None and mask.dtype != torch.float32):
        return False
    if kernel is fused.qkv.kernels:  # tlt's bf16 kernels
        return (cache.dtype in (torch.float32, torch.bfloat16) and fused.head_dim <= cpu_kernels.MAX_HEAD_DIM
                and cos.dtype == torch.bfloat16)
    return (cache.dtype == torch.float32 and not (cache.paired or cache.packed_keys) and cos.dtype == torch.float32
            and fused.head_dim % 2 == 0)


def fused_layer_step(fused: FusedWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     mask: torch.Tensor | None, cache, index: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    """`DecoderLayer.forward` (same arguments, same result up to rounding) on the layer's `fused`
    weights; x [B, T, hidden], or with `counts` [B] the packed [N, hidden] first counts[b] tokens of each
    row (`on_layer_step` only)."""
    H, Hkv, D = fused.heads, fused.kv_heads, fused.head_dim
    if on_layer_step(fused, cache, mask, cos):
        # The whole layer in one call of the kernels (the operators below, without a Python call each).
        keys, values, S = cache.buffers(index, cos.shape[1])
        return fused.step_kernel.layer_step(
            x.contiguous(), -1.0 if fused.input_eps is None else fused.input_eps, fused.weights, fused.sizes,
            fused.biases, fused.scales, H, fused.qk_norm_f32, fused.qk_eps, fused.post_eps, cos, sin, keys, values,
            cache.lengths, S, mask, cache.paired, counts, cache.packed_keys)
    if counts is not None:
        raise ValueError("fused_layer_step: packed tokens (counts) run on the kernels' layer step only")
    B, T, hidden = x.shape
    kernels = _norms(fused)
    x2 = x.reshape(B * T, hidden)
    qkv = fused.qkv(x2 if fused.input_eps is None else _normed(x2, fused.input_eps, kernels)).view(B, T, H + 2 * Hkv, D)
    qk = qkv[:, :, : H + Hkv]  # [B, T, H + H_kv, D]
    if fused.qk_norm is not None:
        qk = _qk_normed(fused, qk)
    qk = apply_rope(qk, cos, sin).transpose(1, 2)  # [B, H + H_kv, T, D]
    q, k = qk[:, :H], qk[:, H:]
    v = qkv[:, :, H + Hkv :].transpose(1, 2)  # [B, H_kv, T, D]
    if cache is not None:
        k, v = cache.write(index, k, v)  # [B, H_kv, S, D]
    out = attend(q, k, v, mask).transpose(1, 2).reshape(B * T, H * D)
    x2 = fused.o.add(x2, out)
    gate_up = fused.gate_up(_normed(x2, fused.post_eps, kernels))  # [B T, 2 I]
    inter = gate_up.shape[1] // 2
    x2 = fused.down.add(x2, F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
    return x2.view(B, T, hidden)
