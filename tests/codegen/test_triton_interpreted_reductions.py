"""Under Triton's interpreter, ember's max and min reductions run through NumPy (codegen/triton.py:
`ember_reduce_extreme_interpreted`), since the interpreter calls a custom combine function per
element, in Python. Both forms run here side by side over the same blocks: NaN anywhere in a row gives
NaN, as the compiled form's NaN-propagating combine (`ember_maximum`) and eager's amax do; infinities and
integers and booleans keep their values and dtypes, narrow ones included (which a sum after the reduction
wraps in). (Narrow floats reduce in float32: docs/decisions.md.)"""

from __future__ import annotations

import pytest
import torch

from ember.backends.direct_launch import load_triton

NAN, INF = float("nan"), float("inf")

KERNEL = """
@triton.jit
def both(X, A, B, C: tl.constexpr, MAX: tl.constexpr):
    rows = tl.arange(0, 8)[:, None]
    x = tl.load(X + rows * C + tl.arange(0, C)[None, :])
    if MAX:
        a = ember_reduce_max(x, 1)
    else:
        a = ember_reduce_min(x, 1)
    b = ember_reduce_extreme_interpreted(x, 1, MAX)
    tl.static_assert(a.dtype == x.dtype and b.dtype == x.dtype)
    tl.store(A + rows, a)
    tl.store(B + rows, b)
"""


def _rows(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(8, 4) > 0.5
    if not dtype.is_floating_point:
        low = 0 if dtype == torch.uint8 else -100
        return torch.randint(low, 100, (8, 4), dtype=dtype)
    x = torch.randn(8, 4).to(dtype)
    x[0, 0] = x[1, 3] = x[2, 1] = NAN  # NaN first, last, in between
    x[3] = NAN  # nothing but NaN
    x[4, 2], x[5] = -INF, -INF  # an infinity among numbers; nothing but -inf
    x[6, 1], x[6, 2] = INF, NAN  # +inf beside NaN
    return x


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.int32, torch.int8, torch.uint8, torch.bool], ids=str
)
@pytest.mark.parametrize("reduction", ["max", "min"])
def test_interpreted_reduction_equals_the_compiled_form_and_eager(dtype, reduction):
    both = load_triton(KERNEL, "ember_test_reductions").both
    x = _rows(dtype)
    a, b = torch.empty(8, 1, dtype=dtype), torch.empty(8, 1, dtype=dtype)
    both[(1,)](x, a, b, C=4, MAX=reduction == "max")
    want = (x.amax if reduction == "max" else x.amin)(1, keepdim=True)
    torch.testing.assert_close(a, want, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(b, want, equal_nan=True, rtol=0, atol=0)


def test_a_narrow_integer_max_keeps_its_dtype_in_the_arithmetic_after_it():
    """int8's max plus the row wraps as in eager (a widened max would not)."""
    from tests.helpers import ember_compile

    x = torch.randint(60, 127, (4, 8), dtype=torch.int8)
    fn = lambda t: (t.amax(1, keepdim=True) + t) > 0
    assert torch.equal(ember_compile(fn, "triton")(x), fn(x))
