"""dtype rules shared by every stage: which dtype a kernel computes in, and reduction identities."""

from __future__ import annotations

import math

import torch

LOW_PRECISION_FLOATS = (torch.bfloat16, torch.float16)
# dtypes ember generates kernels for; a graph touching others runs those ops as externs.
KERNEL_DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Kernels compute low-precision floats in float32 and round only when they store (as Inductor does)."""
    return torch.float32 if dtype in LOW_PRECISION_FLOATS else dtype


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def reduction_identity(kind: str, dtype: torch.dtype) -> float | int | bool:
    """The value a masked-off lane contributes to a reduction of `kind`."""
    if kind == "sum":
        return False if dtype == torch.bool else 0
    if kind == "prod":
        return 1
    if dtype.is_floating_point:
        return -math.inf if kind == "max" else math.inf
    if dtype == torch.bool:
        return kind != "max"
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max
