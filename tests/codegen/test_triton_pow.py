"""pow through Triton's interpreter (no libdevice there): ember_pow's exp2/log2 form with C's rules for signs,
zeros, infinities and NaN, against eager's torch.pow."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ember_compile, explain_strict, repro

NAN, INF = float("nan"), float("inf")
# (base, exponent): odd/even/fractional exponents of negative bases, signed zeros, infinities, NaN, 1 and -1.
PAIRS = [
    (2.0, 3.0), (-2.0, 3.0), (-2.0, 2.0), (0.5, -2.0), (-1.0, 0.5), (0.0, 0.0), (-0.0, -1.0), (-0.0, 3.0),
    (3.0, 0.5), (NAN, 0.0), (1.0, NAN), (NAN, 2.0), (2.0, NAN), (-1.0, INF), (1.0, -INF), (-INF, 3.0),
    (-INF, 0.5), (INF, -2.0), (-2.0, INF), (-0.5, INF), (0.0, -1.0), (-0.5, 2.0), (1.5, 10.3), (0.999, 1000.0),
    (-3.0, -3.0), (0.9, 1e4),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pow_special_values(dtype):
    x = torch.tensor([p[0] for p in PAIRS], dtype=dtype)
    y = torch.tensor([p[1] for p in PAIRS], dtype=dtype)
    fn = torch.pow
    line = repro(backend="triton", dtype=dtype, pairs=len(PAIRS))
    got, want = ember_compile(fn, "triton")(x, y), fn(x, y)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=0, msg=lambda m, line=line: f"{m}\n{line}")
    signed = ~want.isnan()  # a NaN's sign bit is not part of pow's contract
    assert torch.equal(got[signed].signbit(), want[signed].signbit()), (
        f"signs {got.tolist()} != {want.tolist()}\n{line}"
    )
    (kernel,) = explain_strict(fn, x, y, backend="triton").kernels
    assert "ember_pow(" in kernel.source, kernel.source


def test_pow_with_a_literal_operand():
    """A Python-number exponent or base (`x.pow_(-0.5)`, `2.5 ** x`) reaches ember_pow as a literal."""
    x = torch.randn(6)
    for name, fn in {"pow_(-0.5)": lambda t: t.abs().pow_(-0.5), "2.5 ** x": lambda t: torch.pow(2.5, t)}.items():
        torch._dynamo.reset()
        got, want = ember_compile(fn, "triton")(x.clone()), fn(x.clone())
        line = repro(backend="triton", program=name, x=x)
        torch.testing.assert_close(
            got, want, equal_nan=True, rtol=1e-5, atol=0, msg=lambda m, line=line: f"{m}\n{line}"
        )
