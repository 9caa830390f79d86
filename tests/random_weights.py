"""Random weights for the tests' models and drafters, the same for a seed whatever the memory layout."""

import torch


def randomize_(module: torch.nn.Module, scale: float) -> torch.nn.Module:
    """Norm weights uniform in [0.5, 1.5], every other parameter normal(0, scale); each is drawn into a
    contiguous tensor and copied in (an in-place draw into a column-major CPU weight fills it in another
    order, so the same seed would give other weights)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            fresh = torch.empty(p.shape, dtype=p.dtype)
            p.copy_(fresh.uniform_(0.5, 1.5) if "norm" in name else fresh.normal_(0, scale))
    return module
