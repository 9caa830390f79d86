"""Where models run: one spelling for the trainer, the engines and the benchmarks.

"auto" is the first CUDA device when torch sees one, else the CPU; "cpu", "cuda" and "cuda:N" name
one. A CUDA device that is not there fails at once, naming the setting, rather than at the first
tensor moved onto it.
"""

from __future__ import annotations

import re

from tlt.errors import ConfigError

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(name: str, where: str) -> None:
    """Refuse a device name tlt does not know (no hardware is looked at)."""
    if not isinstance(name, str) or not DEVICE_PATTERN.fullmatch(name):
        raise ConfigError(f"{where} must be auto, cpu, cuda or cuda:N, got {name!r}")


def resolve_device(name: str, where: str = "device"):
    """The torch device `name` stands for on this machine; `where` names the setting in errors."""
    import torch

    check_device_name(name, where)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{where} is {name!r} but torch sees no CUDA device on this machine "
                              f"(torch {torch.__version__}); use cpu or auto")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"{where} is {name!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def synchronize(device) -> None:
    """Wait for the device's queued work, so that a timer read after it counts all of it."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def slow_cpu_bf16() -> bool:
    """Whether bf16 products on this CPU take PyTorch's reference kernels: oneDNN has no bf16 products without
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (an AVX2-only CPU, such as AMD's Zen 3), nor does a build without
    oneDNN. There a bf16-autocast forward and backward of the bench preset (tlt sft --preset bench) takes 44x
    float32's time (53.4 s against 1.22 s over 256 tokens on 2 cores of a Zen 3 EPYC, scripts/train_step_cost.py),
    and a bf16 forward of 9 tokens 2.4x float32's, one of 64 rows 4.5x (docs/results/roofline_random_large_zen3_*)."""
    from tlt.model.packed import ONEDNN_BF16

    return not ONEDNN_BF16
