"""bf16 kernels of the CPU decode step (csrc/cpu_bf16.cpp), compiled on first use.

A one-token step of a model that does not fit the last-level cache is bound by streaming its weights.
On this project's 2-core EPYC (AVX-512 BF16) a plain sum reads 29-38 GB/s; oneDNN's prepacked bf16
products stream 11-15 GB/s at one row, this kernel 25-30 GB/s, and it stays as fast or faster than
oneDNN's up to 512 rows (`tlt bench roofline` measures both). It computes each output element with one
float32 accumulator in a fixed order, so a row's result does not depend on how many rows are
multiplied. Its rms norm replaces the several operators (5-60 us each) of `F.rms_norm` in bf16, and its
attention of bf16 queries over the cache (bf16, or float32) reads each kv head's keys once for all the queries
that share it (a 9-token verification over 1500 cached tokens: about half the time of
`scaled_dot_product_attention`).
Where the CPU has AMX (and Linux grants its tile state; `TLT_AMX=0` turns it off) products with bf16
weights whose K is a multiple of 32, and the attention's scores, run on its tiles at every row count
(4-bit weights stay on AVX-512): on two cores of such a Xeon the AVX-512 block does ~235 GFLOP/s and the
tiles ~1950, so a 9-token verification of the bench policy costs 1.04x a one-token step instead of 1.53x.
Over a bf16 cache with paired values (tlt/model/kv_cache.py) the attention also reads the keys and most of
the values' weighted sum on the tiles as they lie in the cache, with no repacking per step; without AMX that
weighted sum runs on AVX-512 bf16 dot products over the paired values (two slots an instruction), and the cache
keeps its keys packed as the products' weight groups, which the scores read in place. A row of a
batch whose rows hold different numbers of cached tokens reads its own keys only (up to its last visible one), and
the threads take tasks (a weight group, a row's kv head) as they come free rather than a fixed half each.
In a layer's step the gate|up product hands back silu(gate) * up itself (`linear(..., silu=True)`: each task
takes a gate group and its up group), the bits of `silu_mul` of the product without writing the product out
and reading it back (the MLP at 216-432 rows: 0.90x the time of the product and `silu_mul` apart).

The extension is built with PyTorch's own toolchain (`torch.utils.cpp_extension`: a C++ compiler and
ninja, ~1 minute once, cached under the torch extensions folder, rebuilt when the source changes).
Where it cannot run (no AVX-512 BF16, no compiler, `TLT_CPU_KERNELS=0`) bf16 products take oneDNN's
prepacked weights, or PyTorch's plain bf16 products where oneDNN packs no bf16 (an AVX2-only CPU), and a
warning names the reason and the path once.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_bf16.cpp"
GROUP = 32  # output columns per packed weight group (csrc/cpu_bf16.cpp)
MAX_HEAD_DIM = 128  # head dims the attention kernel takes (csrc/cpu_bf16.cpp MAX_CHUNKS x 16)
ENV = "TLT_CPU_KERNELS"

_module = None
_reason: str | None = None  # why the kernels are unavailable, once known
_warned = False


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, None where there is none (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _load():
    global _module, _reason
    _module, _reason = load_extension(SOURCE, "tlt_cpu_bf16", {"avx512_bf16"}, "this CPU has no AVX-512 BF16")
    return _module


def load_extension(source: Path, prefix: str, needs: set[str], lacking: str):
    """(the extension built from `source`, None), or (None, why it cannot run): `ENV`=0, a CPU without the flags
    `needs` (`lacking` says so; where /proc/cpuinfo is missing the module's own `supported()` decides), a failed
    build."""
    if os.environ.get(ENV, "1") == "0":
        return None, f"{ENV}=0"
    flags = cpu_flags()
    if flags is not None and not needs <= flags:
        return None, lacking
    module, reason = compiled(source, prefix)
    if module is None:
        return None, reason
    return (module, None) if module.supported() else (None, lacking)


def compiled(source: Path, prefix: str):
    """(the extension built from `source`, None), or (None, why it could not be built). Its name is `prefix` and
    the hash of the source and the headers beside it (which it may include), so a changed source or header is
    rebuilt."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.read_bytes())
    name = f"{prefix}_{digest.hexdigest()[:12]}"
    module = _built(cpp_extension, name)
    try:
        if module is None:
            module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp"],
                                        extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # a missing compiler or ninja, a failed build: the reason is reported
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        first_error = next((line for line in lines if "error" in line.lower()), lines[-1])
        return None, f"building {source} failed ({type(exc).__name__}: {first_error.strip()[:300]})"
    return module, None


def _built(cpp_extension, name: str):
    """The extension already built for this source (its name carries the source's hash), imported
    without `cpp_extension.load`: load takes a lock file in the build folder even when nothing is to be
    built, and a process killed while holding it (or paused by a job scheduler) would leave every later
    process waiting on it. None when there is no built library or it does not import (load rebuilds)."""
    try:
        folder = cpp_extension._get_build_directory(name, False)
        library = Path(folder) / f"{name}.so"
        if not library.is_file():
            return None
        return cpp_extension._import_module_from_library(name, folder, True)
    except Exception:  # a partial library, a changed private API: the regular load decides
        return None


def kernels():
    """The compiled module (`linear`, `rms_norm`), or None where it cannot run; the first None warns with
    the reason."""
    global _warned
    if loaded() is None and not _warned:
        _warned = True
        from tlt.model.packed import ONEDNN_BF16  # packed imports this module

        if ONEDNN_BF16:
            fallback = "bf16 products use oneDNN (a one-token step runs about half as fast)"
        else:  # an AVX2-only CPU (Zen 3 EPYC: a forward of 9 tokens 2.4x float32's time, of 64 rows 4.5x)
            fallback = ("this CPU's oneDNN packs no bf16 either, so bf16 products take PyTorch's plain ones, several "
                        "times slower than float32 from a few rows: prefer float32 (rollout_dtype=float32) here")
        warnings.warn(f"tlt: bf16 CPU kernels unavailable: {_reason}; {fallback}", RuntimeWarning, stacklevel=2)
    return _module


def loaded():
    """The compiled module, or None where it cannot run, without `kernels`' warning (for callers whose
    fallback gives the same result)."""
    if _module is None and _reason is None:
        _load()
    return _module


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (K even) -> [ceil(N / 32), K / 2, 32, 2]: group g holds output columns
    32 g ... 32 g + 31 (zero past N), k in pairs."""
    N, K = weight.shape
    groups = -(-N // GROUP)
    padded = F.pad(weight.detach(), (0, 0, 0, groups * GROUP - N))
    return padded.view(groups, GROUP, K // 2, 2).permute(0, 2, 1, 3).contiguous()


QGROUPS = (128, 64, 32)  # input features per scale of 4-bit weights: the first that divides K


def levels4(weight: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K], padded with zero rows to a multiple of `columns` outputs, rounded to 16 levels per
    output column and k-group of 128 inputs (64 or 32 where K is not a multiple of 128; one group over all
    K where none divides it), evenly spaced from the group's least to its greatest value -> (codes [N', K]
    uint8, scale [N', K / group], low [N', K / group] float32): the weight is scale * code + low."""
    N, K = weight.shape
    padded = -(-N // columns) * columns
    kgroup = next((g for g in QGROUPS if K % g == 0), K)
    w = F.pad(weight.detach().float(), (0, 0, 0, padded - N)).view(padded, K // kgroup, kgroup)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
    codes = ((w - low) / scale).round_().clamp_(0, 15).to(torch.uint8).view(padded, K)
    return codes, scale.squeeze(-1), low.squeeze(-1)


def scales_by_group(first: torch.Tensor, second: torch.Tensor, columns: int) -> torch.Tensor:
    """Two per-column, per-k-group values [N', K / kgroup] -> [N' / columns, K / kgroup, 2, columns]: a group of
    `columns` output columns holds, per k-group, its columns' first values, then their second ones."""
    rows, kgroups = first.shape
    stacked = torch.stack([first, second], dim=1).view(rows // columns, columns, 2, kgroups)
    return stacked.permute(0, 3, 2, 1).contiguous()


def pack4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (K even) rounded as `levels4` does -> (codes [ceil(N / 32), K / 2, 32] uint8, scales
    [ceil(N / 32), K / group, 2, 32] float32). Byte i
    of pair p holds the code of column i / 2 (k = 2p + i % 2) in its low nibble, of column 16 + i / 2 in its
    high one; scales hold scale, then shift = low - 128 scale, the
    form the kernel adds (it multiplies codes as the bf16 numbers 128 + code)."""
    N, K = weight.shape
    codes, scale, low = levels4(weight, GROUP)
    groups = codes.shape[0] // GROUP
    codes = codes.view(groups, GROUP, K // 2, 2).permute(0, 2, 1, 3)  # [G, K / 2, 32 columns, 2]
    packed = codes[:, :, :16].reshape(groups, K // 2, GROUP) | (codes[:, :, 16:].reshape(groups, K // 2, GROUP) << 4)
    return packed.contiguous(), scales_by_group(scale, low - 128 * scale, GROUP)


def unpack4(packed: torch.Tensor, scales: torch.Tensor, N: int) -> torch.Tensor:
    """The float32 weight [N, K] that pack4's output stands for (what the kernel multiplies by)."""
    groups, pairs, _ = packed.shape
    codes = torch.stack([packed & 15, packed >> 4], dim=2).view(groups, pairs, GROUP, 2)  # [G, P, 32, 2]
    codes = codes.permute(0, 2, 1, 3).reshape(groups * GROUP, 2 * pairs).float()
    scale, shift = scales[:, :, 0].permute(0, 2, 1), scales[:, :, 1].permute(0, 2, 1)  # [G, 32, K / kgroup]
    kgroups = scales.shape[1]
    scale = scale.reshape(groups * GROUP, kgroups, 1)
    low = shift.reshape(groups * GROUP, kgroups, 1) + 128 * scale
    weight = codes.view(groups * GROUP, kgroups, -1) * scale + low
    return weight.view(groups * GROUP, -1)[:N]


def layer_step_ops(module, x, input_eps, weights, sizes, biases, scales, H, qk_norm, qk_eps, post_eps, cos, sin,
                   keys, values, slots, S, mask, paired=False, counts=None, packed_keys=False):
    """The compiled `layer_step` as its kernels called one at a time from Python (the same bits, packed
    tokens with `counts` too): what `tlt bench roofline` times call by call to split a step into products
    and attention."""
    if cos.dim() == 4:
        cos, sin = cos[:, :, 0], sin[:, :, 0]
    B, T, hidden = (len(slots), cos.shape[1], x.shape[-1]) if counts is not None else x.shape
    D = keys.shape[3]
    x2 = x.reshape(-1, hidden)
    rows = None
    if counts is not None:  # each real token's place in [B * T]
        rows = (torch.arange(T) < counts[:, None]).flatten().nonzero()[:, 0]
    normed = x2 if input_eps < 0 else module.rms_norm(x2[None], None, input_eps)[0]
    qkv = module.linear(normed, weights[0], sizes[0], biases[0], None, scales[0])
    if rows is not None:
        qkv = qkv.new_zeros(B * T, sizes[0]).index_copy_(0, rows, qkv)
    q = module.rope_write(qkv.view(B, T, sizes[0] // D, D), H, qk_norm, qk_eps, cos, sin, keys, values, slots, paired,
                          packed_keys)
    attended = module.attention(q, keys[:, :, :S], values[:, :, :S], mask, paired, counts, packed_keys).view(B * T, -1)
    if rows is not None:
        attended = attended.index_select(0, rows)
    h = module.linear(attended, weights[1], sizes[1], biases[1], x2, scales[1])
    normed_h = module.rms_norm(h[None], None, post_eps)[0]
    if sizes[2] % (2 * GROUP) == 0:  # silu(gate) * up from the product itself, as layer_step takes it
        act = module.linear(normed_h, weights[2], sizes[2], biases[2], None, scales[2], silu=True)
    else:
        act = module.silu_mul(module.linear(normed_h, weights[2], sizes[2], biases[2], None, scales[2]))
    return module.linear(act, weights[3], sizes[3], biases[3], h, scales[3]).view(x.shape)
