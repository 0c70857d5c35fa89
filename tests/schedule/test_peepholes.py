"""Local simplifications the kernel builder makes, each exact, each checked against eager.

x ** 2/3/4 become products (libdevice's pow goes through log and exp: tanh-gelu's x ** 3 made the
H100's gelu kernel compute-bound), x * 1 is x, and a bf16 value widened to fp32 and narrowed back
is itself (no round trip per load).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import BACKENDS, ember_compile, explain_strict, repro


def _special(n: int) -> torch.Tensor:
    x = torch.randn(n) * 3
    x[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    return x


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_integer_powers_are_products(backend):
    fn = lambda x: F.gelu(x, approximate="tanh") + x.pow(2) + x**4 - x**1 + x**3
    x = _special(64)
    got, want = ember_compile(fn, backend)(x), fn(x)
    torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{m}\n{repro(backend=backend)}")
    (kernel,) = explain_strict(fn, x, backend=backend).kernels
    assert "pow" not in kernel.source, kernel.source


def test_non_integer_power_keeps_pow():
    fn = lambda x: x.abs() ** 2.5
    x = _special(64)
    torch.testing.assert_close(ember_compile(fn, "cpp")(x), fn(x), equal_nan=True)
    (kernel,) = explain_strict(fn, x).kernels
    assert "pow" in kernel.source


def test_bf16_load_has_no_round_trip():
    fn = lambda x, w: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w
    x, w = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    torch.testing.assert_close(ember_compile(fn, "cpp")(x, w), fn(x, w), rtol=2e-2, atol=2e-2)
    (kernel,) = explain_strict(fn, x, w).kernels
    # Two roundings the program asks for (.to(x.dtype), the product's store) and one per mul by a
    # bf16 value; none after a load.
    assert kernel.source.count("ember_f32_to_bf16") <= 3, kernel.source


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "softmax_bf16"])
def test_cpp_row_cache_computes_exp_once(name):
    """C++: exp(x - max) is computed in the sum's pass and kept for the store pass (a per-thread
    row array), not computed twice; rows with -inf and NaN behave as eager's."""
    fns = {
        "softmax": lambda x: x.softmax(-1),
        "log_softmax": lambda x: x.log_softmax(-1) * x.softmax(-1),
        "softmax_bf16": lambda x: x.bfloat16().softmax(-1),
    }
    fn = fns[name]
    x = torch.randn(6, 300)
    x[1] = float("-inf")
    x[2, :100] = float("-inf")
    x[3, 17] = float("nan")
    got, want = ember_compile(fn, "cpp")(x), fn(x)
    torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{m}\n{repro(case=name)}")
    (kernel,) = explain_strict(fn, x).kernels
    # log_softmax * softmax: the two decompositions' max, x - max, exp and sum are the same nodes
    # (ir/cse.py merges them), so one exp, computed once.
    exps = {"softmax": 1, "log_softmax": 1, "softmax_bf16": 1}[name]
    assert kernel.source.count("std::exp(") == exps and "rowcache" in kernel.source, kernel.source
