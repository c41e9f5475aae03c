"""What a device computes natively, for the precision defaults of the learner
(learner.mixed_precision) and the generators (generator.dtype)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def bf16_native(device: str) -> bool:
    """Whether `device` ("cpu", "cuda[:i]") computes bf16 natively: a CUDA GPU that supports it,
    or a CPU whose flags (/proc/cpuinfo; elsewhere none are known) include avx512_bf16 or
    amx_bf16."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.is_bf16_supported()
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})
