"""The memory layout of linear weights: column-major for float32 on the CPU, row-major elsewhere.

Why: a decode step or a draft's verification multiplies a few rows by each weight, and MKL's float32
product of a few rows against a row-major [out, in] weight is several times slower than against the
same weight stored transposed (a plain [in, out] matrix); at 2 threads it falls off a cliff between 12
and 16 rows. At 64 rows and more the two layouts cost the same. A column-major weight is not
contiguous: call `.contiguous()` before `.view()` on it or before `safetensors.torch.save_file` on a
state dict holding it.
"""

from __future__ import annotations

import torch
from torch import nn


def laid_out(w: torch.Tensor) -> torch.Tensor:
    """`w` [out, in] in the layout of `column_major_linears` (`w` itself when it already is): stored
    transposed in memory (strides (1, out)) for a float32 CPU weight, contiguous otherwise."""
    if w.device.type == "cpu" and w.dtype == torch.float32:
        return w if w.t().is_contiguous() else w.t().contiguous().t()
    return w if w.is_contiguous() else w.contiguous()


def column_major_linears(module: nn.Module) -> nn.Module:
    """Lay out the weight of every `nn.Linear` in `module` for the fastest small-row products: a float32
    weight on the CPU is stored transposed in memory (the same [out, in] tensor with strides (1, out)),
    so `F.linear` hands MKL a plain [in, out] matrix; every other weight is row-major as usual. At 2
    threads a [17, 192] x [192, 512] product then takes 48 us instead of 147, [9, 192] x [192, 192] 19
    instead of 58 (the rows of a decode step or a draft's verification); at 64 rows and more the two
    layouts cost the same. Values, shapes, names and saved files do not change; copies into the weights
    (`load_state_dict`, weight sync) keep the layout. An LM head tied to the embedding is left alone
    (embedding lookups read rows). Returns `module`."""
    tied = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for m in module.modules():
            if not isinstance(m, nn.Linear) or id(m.weight) in tied:
                continue
            data = m.weight.data
            fresh = laid_out(data)
            if fresh is not data:
                m.weight.data = fresh
    return module


class ColumnMajorLinears:
    """Mixin for modules holding linear layers: the weight layout of `column_major_linears` is chosen
    again after every move or cast (`.to`, `.float()`, `.bfloat16()`, `.to_empty`)."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        return column_major_linears(self)
