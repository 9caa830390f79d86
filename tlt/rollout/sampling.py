"""Sampling math: warping logits by temperature / top-k / top-p and drawing tokens by inverse CDF.

Pure tensor functions with per-row parameters, shared by plain decoding and by speculative
verification, so both sample from exactly the same warped distribution p:
  1. divide the logits by the temperature;
  2. top-k: keep the k largest logits (ties with the k-th are kept);
  3. top-p: of what is left, keep the most likely tokens up to cumulative probability top_p (the
     token that crosses top_p is kept, so at least one token always survives);
  4. renormalise.
A row with temperature 0 is greedy: its "distribution" is the raw model distribution, whose argmax is
taken (and whose log-prob is reported).
"""

from __future__ import annotations

import torch


def warp_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities [N, V] of the warped distribution (-inf for removed tokens).
    logits: [N, V]; temperature, top_p: [N] float; top_k: [N] long, <= 0 means off."""
    logits = logits.float()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    scaled = logits / t[:, None]  # [N, V]
    V = scaled.shape[-1]
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1.0
    if bool(use_k.any()) or bool(use_p.any()):
        values, order = scaled.sort(dim=-1, descending=True)  # [N, V]
        if bool(use_k.any()):
            k = torch.where(use_k, top_k, torch.full_like(top_k, V)).clamp(1, V)
            kth = values.gather(1, (k - 1)[:, None])  # [N, 1]
            values = values.masked_fill(values < kth, float("-inf"))
        if bool(use_p.any()):
            probs = values.softmax(-1)  # [N, V], sorted descending
            before = probs.cumsum(-1) - probs  # [N, V] mass strictly above each token
            drop = (before >= top_p.float()[:, None]) & use_p[:, None]
            drop[:, 0] = False
            values = values.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(1, order, values)
    return scaled.log_softmax(-1)


def sample_from(logprobs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: token ids [N] from distributions exp(logprobs) [N, V] and uniforms u [N]."""
    cdf = logprobs.double().exp().cumsum(-1)  # [N, V]
    target = (u * cdf[:, -1])[:, None]  # [N, 1]
    # The first index whose cdf exceeds the target: never a zero-probability token.
    return torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)[:, 0]


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N], their log-probs [N]) under the warped distributions; greedy rows take the argmax."""
    logprobs = warp_logprobs(logits, temperature, top_k, top_p)  # [N, V]
    tokens = sample_from(logprobs, u)
    greedy = temperature <= 0
    if bool(greedy.any()):
        tokens = torch.where(greedy, logprobs.argmax(-1), tokens)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
