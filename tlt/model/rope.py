"""Rotary position embeddings and the frequency scalings used by Llama 3 and Qwen checkpoints.

`inverse_frequencies(config)` returns (inv_freq [head_dim/2], attention_scaling). The cos/sin tables are
computed in fp32 from explicit position ids, so the same code serves training (packed or padded rows),
cached decoding and tree drafts (where a node's position is its depth, not its slot).

Supported `rope_type`s: default, linear (position interpolation), llama3 (wavelength-banded scaling)
and yarn (NTK-by-parts with an attention temperature). Dynamic NTK changes the frequencies with the
sequence length at run time, which would make cached and full forwards disagree; it is rejected.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tlt.errors import ConfigError

_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings", "factor"),
}


def check_rope_scaling(scaling: dict[str, Any], field: str = "rope_scaling") -> None:
    """Refuse a scaling tlt does not compute, or one missing a parameter its type needs; `field` names the
    config field holding it in the message."""
    kind = scaling.get("rope_type")
    if kind not in _REQUIRED_KEYS:
        raise ConfigError(f"rope_type {kind!r} is not supported (field {field!r}); expected one of default, "
                          f"{', '.join(_REQUIRED_KEYS)}")
    for key in _REQUIRED_KEYS[kind]:
        value = scaling.get(key)
        if value is None:
            derivable = kind == "yarn" and key == "factor" and key not in scaling
            hint = (' (or "factor": null, which transformers reads as max_position_embeddings / '
                    "original_max_position_embeddings)" if derivable else "")
            raise ConfigError(f"rope scaling of type {kind!r} needs field {key!r} in {field!r}{hint}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"field {key!r} of {field!r} must be a positive number, got {value!r}")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, factor, scaling), 1.0
    return _yarn(head_dim, theta, factor, scaling)


def _llama3(inv_freq: torch.Tensor, factor: float, s: dict[str, Any]) -> torch.Tensor:
    old_len = s["original_max_position_embeddings"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(head_dim: int, theta: float, factor: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    old_len = s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolate = 1 - ramp  # 1 keeps the original frequency, 0 interpolates it fully
    inv_freq = (1.0 / (factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate
    return inv_freq, float(attention)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, T, 1, D] for integer positions [B, T], laid out for `apply_rope`: the first
    half of sin is negated, so rotating is one roll instead of a negated half and a concatenation."""
    angles = positions[..., None, None].float() * inv_freq  # [B, T, 1, D/2]
    cos, sin = angles.cos() * scaling, angles.sin() * scaling
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


class RopeTables:
    """The tables of `rope_tables` for positions 0..n-1, computed once per set of frequencies and dtype
    and grown (doubling) when a forward reaches later positions; a forward gathers its rows instead of
    recomputing them (about ten elementwise ops, 0.1 ms of every one-token step on a CPU). The rows are
    `rope_tables` of the same positions. Built outside inference mode, so training forwards may use
    tables a rollout built. The frequencies are known by identity (the tables hold on to the tensor they
    were built from): a module assigns a new tensor to change them, never edits one in place."""

    def __init__(self) -> None:
        self.key: tuple | None = None  # (inv_freq, scaling, dtype) the tables were built for
        self.cos = self.sin = None  # [n, D]

    def __call__(self, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype,
                 bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, D] for integer positions [B, T]; bound: a number above every position when
        the caller knows one (else it is read off `positions`)."""
        if positions.numel() == 0:
            return rope_tables(positions, inv_freq, scaling, dtype)
        bound = int(positions.max()) + 1 if bound is None else bound
        same = self.key is not None and self.key[0] is inv_freq and self.key[1:] == (scaling, dtype)
        size = self.cos.shape[0] if same else 0
        if size < bound:
            with torch.inference_mode(False), torch.no_grad():
                cos, sin = rope_tables(torch.arange(max(bound, 2 * size, 256), device=inv_freq.device)[None],
                                       inv_freq, scaling, dtype)
            self.cos, self.sin, self.key = cos[0, :, 0], sin[0, :, 0], (inv_freq, scaling, dtype)
        return (torch.nn.functional.embedding(positions, self.cos)[..., None, :],
                torch.nn.functional.embedding(positions, self.sin)[..., None, :])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by the tables of `rope_tables` (rotate-half convention): x * cos +
    rotate_half(x) * sin, where rotate_half(x) = (-x2, x1) = roll(x) * (-1, 1) elementwise."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
