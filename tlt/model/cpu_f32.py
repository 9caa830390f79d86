"""float32 products of the CPU decode step on AVX2 (csrc/cpu_f32.cpp), compiled on first use.

Where the CPU has no AVX-512 (AMD's Zen 3 EPYC, for one) tlt decodes in float32: oneDNN packs no bf16 there
and PyTorch's own bf16 products are several times slower (tlt/model/packed.py). oneDNN's prepacked float32
products cost about twice as much at 2-9 rows as at one: on 2 cores of a Zen 3 EPYC the bench policy's 48
products (368 MB) took 18.7 ms at one row and 24.1-32.5 ms at 2-9 rows, where this kernel takes 13.9 ms and
14.5-16.7 ms (`python scripts/f32_rows.py --threads 2`, docs/results/f32_rows_zen3.json). Blocks of up to 6
rows (of nearly equal size) take a weight group's inputs chunk by chunk, all blocks one chunk before the next,
so the group streams from memory once while every block multiplies by it; from about 9 rows the products are
bound by AVX2's arithmetic (32 FLOP a cycle a core), and at 64-256 rows it runs 159 GFLOP/s against oneDNN's
119-129. Rows come in tiles of 48, so a pass over thousands of rows (log-probs) rereads the weights per tile and
runs at about MKL's rate.

4-bit weights (`pack4`, a drafter's `drafter_bits=4`: 16 levels per column and k-group of 128 inputs, as the
bf16 kernels round them) stream an eighth of the float32 bytes, and expanding the codes, not memory, bounds
their products: scale and low value are taken out of each k-group's sum, so the codes are multiplied as they
are, each row's sum runs in two chains (even and odd inputs) and rows come in blocks of 2. A row's result
does not depend on the rows beside it; it is the product by the weight the codes stand for (`unpack4`) within
float32 rounding.

Where a layer's four products all take it, the whole layer is one call (`layer_step`, tlt/model/fused.py): its rms
norms, the q/k norm with RoPE and the cache write (`rope_write`), attention over the float32 cache (`attention`) and
silu(gate) * up (`silu_mul`) run in the kernel beside the products: on 2 cores of a Zen 3 EPYC a 174 M-parameter
model's one-token step ran 1.34x faster than with those operators, a 9-token one 1.15x, and the bench policy decoded
1.19x faster at batch 1 (docs/results/README.md, "On a CPU without bf16 products"). Attention takes a kv head's
queries together; a query's scores are sums over the head's dimensions in a fixed order, and its softmax sum and
weighted sum of values run in slot order over the keys it sees, a hidden key adding nothing, so a tree node's query
gets plain decoding's bits.

On float32 weights each output element is one float32 sum over the inputs in order, whatever the number of
rows, so a row's result does not depend on how many rows are multiplied (oneDNN's float32 kernels round
differently by row count): a verification's products give each row what the one-token step's do, bit for bit.

`preferred()`: the kernel takes large float32 weights (packed.should_pack) on CPUs with AVX2 and FMA but
no AVX-512, where it was measured; CPUs with AVX-512 keep oneDNN's float32 products. The extension is built
as tlt's bf16 kernels are (tlt/model/cpu_kernels.py: ~30 s once, cached); where it cannot be built, or
`TLT_CPU_KERNELS=0`, float32 products take oneDNN's prepacked weights, and a warning names the reason once.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from tlt.model import cpu_kernels

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_f32.cpp"
GROUP = 16  # output columns per packed weight group (csrc/cpu_f32.cpp)

_module = None
_reason: str | None = None
_warned = False


def preferred() -> bool:
    """Whether large float32 weights should take this kernel here: AVX2 and FMA without AVX-512 (measured on a
    Zen 3 EPYC only)."""
    flags = cpu_kernels.cpu_flags()
    return flags is not None and {"avx2", "fma"} <= flags and "avx512f" not in flags


def _load():
    global _module, _reason
    _module, _reason = cpu_kernels.load_extension(SOURCE, "tlt_cpu_f32", {"avx2", "fma"},
                                                  "this CPU has no AVX2 and FMA")
    return _module


def kernels():
    """The compiled module (`linear`, `rms_norm`, `rope_write`, `attention`, `silu_mul`, `layer_step`), or None where
    it cannot run (the first None warns with the reason)."""
    global _warned
    if _module is None and _reason is None:
        _load()
    if _module is None and not _warned:
        _warned = True
        warnings.warn(f"tlt: float32 CPU kernel unavailable: {_reason}; float32 products use oneDNN (a product over "
                      f"2-9 rows about twice one over a single row)", RuntimeWarning, stacklevel=2)
    return _module


def loaded():
    """The compiled module where something has already loaded it, else None: neither builds it nor warns (for a
    caller whose fallback gives the same result and that should not build the kernel for it, a float32 cache's mask
    on a model whose products do not take the kernel)."""
    return _module


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> [ceil(N / 16), K, 16]: group g holds output columns 16 g ... 16 g + 15 (zero
    past N)."""
    N, K = weight.shape
    groups = -(-N // GROUP)
    padded = F.pad(weight.detach().float(), (0, 0, 0, groups * GROUP - N))
    return padded.reshape(groups, GROUP, K).transpose(1, 2).contiguous()


def pack4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] rounded to 16 levels per output column and k-group (`cpu_kernels.levels4`) -> (codes
    [ceil(N / 16), K, 8] uint8, scales [ceil(N / 16), K / kgroup, 2, 16] float32): byte j of (g, k) holds the
    code of column 16 g + j in its low nibble and of 16 g + 8 + j in its high one; scales hold each column's
    scale, then its low value (the weight is scale * code + low)."""
    N, K = weight.shape
    codes, scale, low = cpu_kernels.levels4(weight, GROUP)
    groups = codes.shape[0] // GROUP
    codes = codes.view(groups, GROUP, K).transpose(1, 2)  # [G, K, 16]
    packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2 :] << 4)
    return packed.contiguous(), cpu_kernels.scales_by_group(scale, low, GROUP)


def unpack4(packed: torch.Tensor, scales: torch.Tensor, N: int) -> torch.Tensor:
    """The float32 weight [N, K] that pack4's output stands for: scale * code + low (the kernel's products are
    the products by it, within float32 rounding)."""
    groups, K, _ = packed.shape
    codes = torch.cat([packed & 15, packed >> 4], dim=2).float()  # [G, K, 16]
    kgroups = scales.shape[1]
    per_k = scales.repeat_interleave(K // kgroups, dim=1)  # [G, K, 2, 16]
    weight = codes * per_k[:, :, 0] + per_k[:, :, 1]
    return weight.transpose(1, 2).reshape(groups * GROUP, K)[:N]
