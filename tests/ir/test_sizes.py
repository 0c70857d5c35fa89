"""Symbolic sizes: IndexDiv/IndexMod evaluation rules, strides, affine splitting."""

from __future__ import annotations

import pytest
import sympy

from ember.ir.sizes import IndexDiv, IndexMod, affine_split, as_expr, contiguous_strides, index_symbol, is_static

I = sympy.Integer
x, y = index_symbol("x"), index_symbol("y")
s = sympy.Symbol("s", integer=True, positive=True)


@pytest.mark.parametrize(
    "expr,expected",
    [
        (IndexDiv(I(7), I(2)), I(3)),
        (IndexMod(I(7), I(2)), I(1)),
        (IndexDiv(x, 1), x),
        (IndexMod(x, 1), I(0)),
        (IndexDiv(I(0), s), I(0)),
        (IndexDiv(4 * x + 8, 4), x + 2),  # exact division
        (IndexMod(4 * x + y, 4), IndexMod(y, 4)),  # multiples of 4 drop out
        (IndexMod(4 * x + 8, 4), I(0)),
        (IndexDiv(s * x, s), x),
        (IndexMod(s * x + y, s), IndexMod(y, s)),
    ],
)
def test_index_div_mod_rules(expr, expected):
    assert sympy.expand(expr - expected) == 0, f"{expr} != {expected}"


def test_index_div_mod_stay_symbolic_when_inexact():
    assert isinstance(IndexDiv(x + 1, 4), IndexDiv)
    assert isinstance(IndexMod(x, 4), IndexMod)
    assert IndexDiv(x, 4).is_integer and IndexMod(x, 4).is_integer


def test_contiguous_strides():
    assert contiguous_strides((I(2), I(3), I(4))) == (12, 4, 1)
    assert contiguous_strides((s, I(3))) == (3, 1)
    assert contiguous_strides((I(3), s)) == (s, 1)
    assert contiguous_strides(()) == ()


def test_affine_split():
    assert affine_split(3 * x + 2 * y + 5, x) == (3, 2 * y + 5)
    assert affine_split(2 * y, x) == (0, 2 * y)
    assert affine_split(s * x + y, x) == (s, y)
    assert affine_split(x * x, x) is None
    assert affine_split(IndexDiv(x, 2), x) is None


def test_as_expr():
    assert as_expr(3) == I(3)
    assert as_expr(s) is s
    assert is_static(as_expr(3)) and not is_static(s + 1)
    with pytest.raises(TypeError):
        as_expr(True)
    with pytest.raises(TypeError):
        as_expr("3")


def test_python_division_of_a_negated_size_keeps_its_floor_semantics():
    """torch records Python's `-(-n // 128)` (a ceiling division) and `-n % 128` (a padding to a
    multiple) as FloorDiv and modulo of a negative numerator; the kernels divide as C does, toward
    zero, so these are rewritten over the (non-negative) negation. Each form is checked at sizes on
    and off the multiple."""
    from torch.utils._sympy.functions import FloorDiv, PythonMod

    from ember.ir.sizes import from_torch_sympy

    n = sympy.Symbol("s0", integer=True, nonnegative=True)
    ceil_div = -from_torch_sympy(FloorDiv(-n, 128))
    padding = from_torch_sympy(PythonMod(-n, 128))
    for size in (1, 56, 127, 128, 129, 300):
        assert _as_c_computes(ceil_div, size) == -(-size // 128)
        assert _as_c_computes(padding, size) == -size % 128


def test_python_division_of_a_size_of_either_sign_is_refused_unless_its_range_decides():
    from torch.utils._sympy.functions import PythonMod
    from torch.utils._sympy.value_ranges import ValueRanges

    from ember.ir.sizes import from_torch_sympy

    n = sympy.Symbol("s0", integer=True, nonnegative=True)
    with pytest.raises(TypeError, match="may be negative or positive"):
        from_torch_sympy(PythonMod(3 - n, 8))
    # With n >= 4 known (a slice x[3:] of a non-empty result), 3 - n is never positive.
    padding = from_torch_sympy(PythonMod(3 - n, 8), ranges={n: ValueRanges(4, 1 << 20)})
    for size in (4, 11, 12, 37):
        assert _as_c_computes(padding, size) == (3 - size) % 8


def test_rounded_true_division_of_a_size_is_an_integer_division():
    import math

    from torch.utils._sympy.functions import CeilToInt, FloorToInt, IntTrueDiv, TruncToInt

    from ember.ir.sizes import from_torch_sympy

    n = sympy.Symbol("s0", integer=True, nonnegative=True)
    forms = {
        "floor": (FloorToInt(IntTrueDiv(n, 32)), lambda v: math.floor(v / 32)),
        "int": (TruncToInt(IntTrueDiv(n, 32)), lambda v: int(v / 32)),
        "ceil": (CeilToInt(IntTrueDiv(n, 32)), lambda v: math.ceil(v / 32)),
        "ceil of a negation": (CeilToInt(IntTrueDiv(-n, 32)), lambda v: math.ceil(-v / 32)),
    }
    for name, (torch_expr, python) in forms.items():
        ours = from_torch_sympy(torch_expr)
        for size in (0, 1, 31, 32, 33, 100):
            assert _as_c_computes(ours, size) == python(size), (name, size)


def _as_c_computes(expr, size: int) -> int:
    """`expr` at s0 = size, with IndexDiv and IndexMod computed as the kernels do (toward zero); they
    must only ever see non-negative operands, where that equals Python's floor."""
    if expr.is_Symbol:
        return size
    if expr.is_Integer:
        return int(expr)
    args = [_as_c_computes(e, size) for e in expr.args]
    if isinstance(expr, (IndexDiv, IndexMod)):
        a, b = args
        assert a >= 0 and b > 0, f"{expr} at {size}: a negative operand, which C divides otherwise"
        return a // b if isinstance(expr, IndexDiv) else a % b
    if expr.is_Add:
        return sum(args)
    if expr.is_Mul:
        out = 1
        for a in args:
            out *= a
        return out
    raise AssertionError(f"unexpected {expr}")
