"""Inference products on CPU weights prepacked for oneDNN: the decode path of models that stream from memory.

A decode step of a model larger than the CPU's last-level cache streams every weight from DRAM once, so
its time is bound by weight bytes / bandwidth, and a forward over a few tokens (a draft's verification)
should cost what one over a single token costs. MKL's products on plain weights miss that: on this
project's 2-core EPYC, [M, 1024] x [1024, 4096] in float32 costs 3-4x more at M = 4-17 than at M = 1,
and bf16 through `F.linear` runs at half the bandwidth. Weights reordered once into oneDNN's blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`, multiplied by `_linear_pointwise`) cost about the same
for M = 1..17 in bf16. Their one-row bf16 kernel streams 10-16 GB/s where a plain sum reads 27-39 GB/s,
so the kernel, not the memory, bounds a one-token step (`tlt bench roofline` measures both). bf16
weights therefore take tlt's own kernel (tlt/model/cpu_kernels.py: 25-30 GB/s at one row, as fast as
oneDNN or faster up to 512 rows) where it runs, and oneDNN's otherwise (where oneDNN packs bf16: below).
On CPUs without AVX-512 (float32 is their decode dtype) large float32 weights take tlt's AVX2 kernel
(tlt/model/cpu_f32.py): oneDNN's float32 products there cost about twice as much at 2-9 rows as at one.

Packing has a fixed cost of 10-20 us a call, so it pays only where the weight streams from memory:
`should_pack` packs every bf16 weight that oneDNN can pack (plain bf16 products are slower at every size
measured) and float32
weights of at least PACK_MIN_BYTES; smaller float32 weights (the default model's, inside L3) keep the
column-major layout of tlt/model/layout.py, whose MKL products are the faster there.

`PackedLinear` is a frozen snapshot of one weight (and bias), rebuilt by its holder's `Prepared` when the
parameter changes. With bits=4 (a drafter's products, `Drafter.set_weight_bits`) a weight that one of tlt's
kernels takes is rounded to 16 levels per column and group of 128 inputs (`cpu_kernels.levels4`): a quarter of
a bf16 weight's bytes to stream (`cpu_kernels.pack4`), an eighth of a float32 one's (`cpu_f32.pack4`); other
weights ignore it. Where oneDNN is missing or cannot pack (a CPU build without it, a GPU tensor) the
same object multiplies the plain weight; so does a bf16 weight on a CPU whose oneDNN cannot pack bf16 (no
AVX-512 and no AVX-NE-CONVERT: AVX2-only CPUs), through PyTorch's own bf16 products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tlt.model import cpu_f32, cpu_kernels
from tlt.model.layout import laid_out

PACK_MIN_BYTES = 1 << 20  # float32 weights smaller than this stay in MKL's column-major layout
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
ONE_ROW_PAD = 4  # rows a single bf16 row is multiplied as on oneDNN (`PackedLinear._padded`)
KERNELS = True  # products on tlt's kernels where they run (tests turn them off to take the other paths)
F32_KERNEL = cpu_f32.preferred()  # large float32 weights on tlt's AVX2 kernel: CPUs without AVX-512 (tests force it)


def _probe_onednn(dtype: torch.dtype) -> bool:
    """Whether this build and CPU multiply by prepacked oneDNN weights of `dtype`: a CPU build without oneDNN
    has no ops, and oneDNN packs bf16 only where the CPU has AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (an
    AVX2-only CPU, such as AMD's Zen 3, refuses with a RuntimeError)."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2, dtype=dtype), 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2, dtype=dtype), w, None, "none", [], "")
        return bool(torch.backends.mkldnn.is_available()) and float(out.float().sum()) == 4.0
    except (AttributeError, RuntimeError):
        return False


ONEDNN = _probe_onednn(torch.float32)
ONEDNN_BF16 = ONEDNN and _probe_onednn(torch.bfloat16)  # else bf16 weights keep F.linear's plain products


def should_pack(weight: torch.Tensor) -> bool:
    """Whether products with `weight` [out, in] are faster on prepacked oneDNN weights (module docstring);
    never for a dtype this CPU's oneDNN cannot pack."""
    if not ONEDNN or weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        return False
    if weight.dtype == torch.bfloat16:
        return ONEDNN_BF16
    return weight.numel() * weight.element_size() >= PACK_MIN_BYTES


def kernels_for(weight: torch.Tensor):
    """tlt's bf16 kernels (cpu_kernels) for products with `weight` [out, in], or None: they take bf16 CPU
    weights of an even input size."""
    if not KERNELS or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        return None
    return cpu_kernels.kernels()


def f32_kernel_for(weight: torch.Tensor):
    """tlt's float32 kernel (cpu_f32) for products with `weight` [out, in], or None: it takes float32 CPU weights of
    at least PACK_MIN_BYTES (those packed for oneDNN elsewhere; it needs no oneDNN) on CPUs without AVX-512
    (F32_KERNEL)."""
    if not (KERNELS and F32_KERNEL) or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return cpu_f32.kernels() if weight.numel() * weight.element_size() >= PACK_MIN_BYTES else None


class PackedLinear:
    """x @ weight^T + bias for inference, on a weight prepacked once when `should_pack` says it pays.
    A packed weight is a copy, a plain one may be a view of the parameter: either way the owner rebuilds
    this object when the parameter changes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, bits: int = 16) -> None:
        if bits not in (4, 16):
            raise ValueError(f"bits must be 4 or 16, got {bits!r}")
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        self.out_features, self.in_features = weight.shape
        self.kernels = kernels_for(weight)
        self.f32_kernel = f32_kernel_for(weight)
        # the compiled module whose `linear` multiplies by this weight (tlt's bf16 or float32 kernel), or None
        self.kernel = self.kernels if self.kernels is not None else self.f32_kernel
        self.on_kernel = self.kernel is not None
        self.packed = self.on_kernel or should_pack(weight)
        self.scales = None  # of 4-bit weights
        if self.on_kernel:  # each kernel's module packs for it: pack, or pack4 for 4-bit weights
            packing = cpu_kernels if self.kernels is not None else cpu_f32
            if bits == 4:
                self.weight, self.scales = packing.pack4(weight)
            else:
                self.weight = packing.pack(weight)
            self.weight_t = None
        elif self.packed:
            # The batch-size hint only picks the reorder's blocking; 1 serves decode rows best.
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
            self.weight_t = None
        else:
            self.weight = laid_out(weight)
            self.weight_t = self.weight.t()  # [in, out], for addmm
        if bias is not None and self.on_kernel:
            bias = bias.float().contiguous()  # the kernels add a float32 bias
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.on_kernel:
            out = self._kernel_linear(_rows(x.reshape(-1, self.in_features)), None)
            return out.view(*x.shape[:-1], self.out_features)
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)  # always 2-D: one oneDNN primitive kind, row results independent of M
        out = torch.ops.mkldnn._linear_pointwise(self._padded(rows), self.weight, self.bias, "none", [], "")
        return out[: rows.shape[0]].view(*x.shape[:-1], self.out_features)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ weight^T (+ bias), both 2-D: residual [N, out], x [N, in]; the sum is formed
        inside the product."""
        if self.on_kernel:
            return self._kernel_linear(_rows(x), _rows(residual))
        if self.packed:
            out = torch.ops.mkldnn._linear_pointwise(self._padded(x), self._padded(residual), self.weight, self.bias, "add")
            return out[: x.shape[0]]
        out = torch.addmm(residual, x, self.weight_t)
        return out if self.bias is None else out.add_(self.bias)

    def _kernel_linear(self, rows: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """rows [N, in] @ weight^T (+ bias) (+ residual [N, out]) on tlt's kernel: the bf16 one, or the float32 one."""
        return self.kernel.linear(rows, self.weight, self.out_features, self.bias, residual, self.scales)

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        """A single bf16 row repeated ONE_ROW_PAD times: oneDNN's one-row bf16 kernel streams the weight
        more slowly than its few-row one (one-token steps of `tlt bench roofline`'s random-large model
        about 1.1x faster, paired). Each row's result does not depend on how many rows are multiplied."""
        if rows.shape[0] == 1 and rows.dtype == torch.bfloat16:
            return rows.expand(ONE_ROW_PAD, -1).contiguous()
        return rows


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, C] with contiguous rows, as the kernels read it."""
    return x if x.stride(-1) == 1 else x.contiguous()


class Prepared:
    """A value derived from tensors (prepared weights), rebuilt when any of them changes: each is known by
    its storage and version counter, which every in-place update bumps (optimizer steps,
    `load_state_dict`, `copy_` under `torch.no_grad()`), as does moving, casting or replacing it. The
    tensors themselves are held until the next rebuild, so a replaced parameter's memory cannot be
    reused by a new one that would then look unchanged. Copies and pickles of the owner start empty: a
    copy's parameters are new storage, and oneDNN's packed tensors cannot be copied."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.sources: list[torch.Tensor] = []
        self.value = None

    def get(self, tensors: list[torch.Tensor], build):
        """The value built from `tensors`, by `build()` when they changed since the last call."""
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        if self.key != key:
            self.value, self.key, self.sources = build(), key, tensors
        return self.value

    def __getstate__(self) -> dict:
        return {"key": None, "sources": [], "value": None}


def inference_linear(prepared: Prepared, linear: torch.nn.Linear, x: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """`linear(x)`, through a PackedLinear of its current weights (`bits` as PackedLinear's) held in
    `prepared` when no gradient is recorded."""
    if torch.is_grad_enabled():
        return linear(x)
    w, b = linear.weight, linear.bias
    return prepared.get([w] if b is None else [w, b], lambda: PackedLinear(w, b, bits))(x)
