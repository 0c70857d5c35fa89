"""The float64 rule for one tensor, as PyTorch's dynamo benchmarks apply it (accuracy.py says how a
case is checked with it): a compiled tensor passes if it is allclose to eager's (rtol = atol = tol),
or else if RMSE(compiled, fp64) <= m * RMSE(eager, fp64) + tol / 10, m = 3 for bfloat16/float16 and
2 otherwise. It knows nothing of workloads, so that every bench part that checks tensors can use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOW = (torch.bfloat16, torch.float16)


def rmse(a: torch.Tensor, ref: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return torch.sqrt(torch.mean((a.detach().double() - ref.detach().double()) ** 2)).item()


def tolerance_for(low_precision: bool, train: bool) -> float:
    """tol: 1e-2 for low-precision workloads (bf16 or autocast), else 1e-3 in training, 1e-4 in inference."""
    if low_precision:
        return 1e-2
    return 1e-3 if train else 1e-4


@dataclass
class TensorCheck:
    name: str
    passed: bool
    how: str  # "allclose" | "rmse" | why it failed
    eager_rmse: float
    compiled_rmse: float
    bound: float

    def record(self) -> dict:
        return dict(self.__dict__)


def check_tensor(name: str, compiled, eager, ref, tol: float) -> TensorCheck:
    """The float64 rule for one tensor (see the module docstring)."""
    if not isinstance(compiled, torch.Tensor) or compiled.shape != eager.shape:
        shape = tuple(compiled.shape) if isinstance(compiled, torch.Tensor) else type(compiled).__name__
        return TensorCheck(name, False, f"shape {shape} != eager {tuple(eager.shape)}", math.nan, math.nan, math.nan)
    if compiled.dtype != eager.dtype:
        return TensorCheck(name, False, f"dtype {compiled.dtype} != eager {eager.dtype}", math.nan, math.nan, math.nan)
    if not eager.is_floating_point():
        same = torch.equal(compiled, eager)
        return TensorCheck(name, same, "equal" if same else "integer values differ", 0.0, 0.0, 0.0)
    e_err, c_err = rmse(eager, ref), rmse(compiled, ref)
    multiplier = 3.0 if eager.dtype in LOW else 2.0
    bound = multiplier * e_err + tol / 10
    if torch.allclose(compiled.double(), eager.double(), rtol=tol, atol=tol, equal_nan=True):
        return TensorCheck(name, True, "allclose", e_err, c_err, bound)
    if c_err <= bound:  # NaN fails
        return TensorCheck(name, True, "rmse", e_err, c_err, bound)
    return TensorCheck(
        name, False, f"RMSE {c_err:.3g} > {multiplier:g} x {e_err:.3g} + {tol / 10:g}", e_err, c_err, bound
    )


def ratio(c: TensorCheck) -> float:
    """How close to its bound a tensor's compiled error is (0 = exact, 1 = at the bound)."""
    if c.how in ("allclose", "equal"):
        return 0.0
    return c.compiled_rmse / c.bound if c.bound and not math.isnan(c.bound) else math.inf
