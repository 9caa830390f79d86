"""Scaled dot-product attention for every forward of the model, with grouped-query heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# On a GPU in half precision, SDPA would pick cuDNN's attention, which plans anew for every shape it meets: a
# decode step's key count grows by one each step, so every call re-plans (on an H200, 5.4 ms of CPU per
# call: a bf16 rollout of the default model ran 5.6x slower than float32's). Flash and memory-efficient
# attention take any shape at launch cost.
GPU_HALF_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of q [B, H, T, D] over keys/values [B, H_kv, S, D] (query head h reads kv head
    h // (H / H_kv)), with the additive `mask` [B, 1, T, S], or causal over the last T keys when None.
    Keys and values cached in another dtype than q (float32 for a bf16 model on the CPU, see
    tlt/model/kv_cache.py) take q to theirs and the result back; a bf16 cache on the CPU with its
    float32 mask runs in float32 like a float32 cache (both hold the same values). One new float32
    token per row in a CPU batch of 8 or more (a decode step) takes two batched matmuls and a softmax: CPU
    scaled_dot_product_attention runs them 2-3x slower there (8 rows x 300 keys: 384 us against 194;
    64 rows: 5.1 ms against 1.8, per layer, 2 threads). Everything else goes to
    scaled_dot_product_attention (half precision on a GPU without cuDNN's backend: GPU_HALF_BACKENDS)."""
    if q.device.type == "cpu" and k.dtype == torch.bfloat16 and mask is not None and mask.dtype == torch.float32:
        # a bf16 cache (its masks are float32): float32 arithmetic, as over a float32 cache
        return attend(q.float(), k.float(), v.float(), mask).to(q.dtype)
    if q.dtype != k.dtype:
        return attend(q.to(k.dtype), k, v, mask).to(q.dtype)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if T == 1 and B >= 8 and q.device.type == "cpu" and q.dtype == torch.float32:
        scores = torch.matmul(q.reshape(B, Hkv, H // Hkv, D), k.transpose(-1, -2)) * D**-0.5  # [B, H_kv, G, S]
        if mask is not None:
            scores = scores + mask  # [B, 1, 1, S] over every head
        return torch.matmul(scores.softmax(-1), v).view(B, H, 1, D)
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        with sdpa_kernel(GPU_HALF_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                                  enable_gqa=H != Hkv)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                          enable_gqa=H != Hkv)
