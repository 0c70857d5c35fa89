"""Symbolic sizes and index arithmetic.

Sizes are sympy expressions: integers for static shapes, symbols (`s0`, `s1`, ...) for the
sizes Dynamo marks dynamic. Index math uses two functions of our own, `IndexDiv` and
`IndexMod`, which are floor division and modulo on non-negative integers; unlike sympy's
`floor`/`Mod` they print directly as `//` and `%` and simplify only where that is exact.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import sympy

Expr = sympy.Expr


class IndexDiv(sympy.Function):
    """floor(a / b) for non-negative integers a and positive integer b."""

    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        # (c*b*x + ...)//b where every term is a multiple of b: exact division.
        terms = sympy.Add.make_args(sympy.expand(a))
        if all(divides(b, t) for t in terms):
            return sympy.expand(a / b)
        return None


class IndexMod(sympy.Function):
    """a mod b for non-negative integers a and positive integer b."""

    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1 or a == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) % int(b))
        terms = sympy.Add.make_args(sympy.expand(a))
        kept = [t for t in terms if not divides(b, t)]
        if len(kept) < len(terms):
            return IndexMod(sympy.Add(*kept), b)
        return None


def divides(b: Expr, term: Expr) -> bool:
    """Whether term/b is a monomial with an integer coefficient (so the division is exact)."""
    coeff, rest = (term / b).as_coeff_Mul()
    if not coeff.is_Integer:
        return False
    return all(
        f == 1 or f.is_Symbol or isinstance(f, (IndexDiv, IndexMod)) or (f.is_Pow and f.exp.is_Integer and f.exp > 0)
        for f in sympy.Mul.make_args(rest)
    )


@functools.cache
def index_symbol(name: str) -> sympy.Symbol:
    """A symbol for a loop index or a size: integer and non-negative, so sympy simplifies safely.
    Kept per name: the scheduler asks for the same few names hundreds of thousands of times."""
    return sympy.Symbol(name, integer=True, nonnegative=True)


def as_expr(x: Any) -> Expr:
    """An int, SymInt or sympy expression as a sympy expression."""
    if isinstance(x, sympy.Expr):
        return x
    if isinstance(x, (bool,)):
        raise TypeError(f"bool is not a size: {x!r}")
    if isinstance(x, int):
        return sympy.Integer(x)
    node = getattr(x, "node", None)  # torch.SymInt
    if node is not None and hasattr(node, "expr"):
        return sympy.expand(from_torch_sympy(node.expr, symbol_ranges(node)))
    raise TypeError(f"not a size: {x!r} ({type(x).__name__})")


def symbol_ranges(node: Any) -> dict | None:
    """The value range of each symbol of torch's SymNode `node`, from its ShapeEnv (None: none known)."""
    return getattr(getattr(node, "shape_env", None), "var_to_range", None)


def _may_be_negative(symbol: sympy.Symbol, ranges: dict) -> bool:
    """Whether a symbol may stand for a negative integer (a Python int argument under dynamic shapes, or
    `.item()` of a tensor, as opposed to a size); one its ShapeEnv does not know counts as such."""
    known = ranges.get(symbol)
    return known is None or bool(known.lower < 0)


def from_torch_sympy(expr: Expr, ranges: dict | None = None) -> Expr:
    """Rewrite torch's own index functions (FloorDiv, ModularIndexing, CeilDiv, ...) into ours.

    Symbols are re-made integer and non-negative (sizes), which our simplifications assume. `ranges`
    (symbol_ranges: None where unknown, every symbol then a size) decides where that fails: an
    expression whose value depends on the sign of a symbol that may be negative (a comparison, max/min,
    floor division or modulo, which the kernels compute as C does) is refused rather than simplified
    wrongly (`max(n, 0)` would become `n`, `n >= 0` True), and a division's numerator is bounded by
    them (`_signed_division`).
    """
    if ranges is not None and _sign_sensitive(expr) and any(_may_be_negative(s, ranges) for s in expr.free_symbols):
        raise TypeError(
            f"size expression {expr} compares, divides or takes max/min of an integer that may be negative "
            "(a Python int under dynamic shapes, or .item()): ember's size arithmetic assumes non-negative integers"
        )
    return _converted(expr, ranges)


def _converted(expr: Expr, ranges: dict | None) -> Expr:
    if not expr.args:
        return index_symbol(expr.name) if expr.is_Symbol else expr
    rounded = _rounded_true_division(expr, ranges)
    if rounded is not None:
        return rounded
    args = [_converted(a, ranges) for a in expr.args]
    kind = type(expr).__name__
    if kind in _SIGNED_DIVISIONS:
        sign = _sign(expr.args[0], args[0], ranges)
        return _ceil_division(*args, sign) if kind == "CeilDiv" else _signed_division(kind, *args, sign)
    rule = _TORCH_INDEX_FUNCTIONS.get(kind)
    if rule is not None:
        return rule(*args)
    if isinstance(expr, (sympy.Add, sympy.Mul, sympy.Pow, sympy.core.relational.Relational, *_CONNECTIVES)):
        return expr.func(*args)  # a relation: a SymBool's condition (a size check, a branch predicate)
    raise TypeError(f"size expression {expr} uses {kind}, which ember does not generate code for")


_CONNECTIVES = (sympy.And, sympy.Or, sympy.Not)  # of relations: a SymBool's condition


def _sign_sensitive(expr: Expr) -> bool:
    """Whether any part of torch's expression depends on the sign of its symbols: a relation, a connective,
    max/min or an integer division or modulo."""
    return any(
        isinstance(e, (sympy.core.relational.Relational, *_CONNECTIVES))
        or type(e).__name__ in _TORCH_INDEX_FUNCTIONS
        or type(e).__name__ in _SIGNED_DIVISIONS
        for e in sympy.preorder_traversal(expr)
    )


# Python's floor division and modulo, which torch records for `a // b` and `a % b` over sizes, and
# its ceiling division.
_SIGNED_DIVISIONS = ("FloorDiv", "CeilDiv", "PythonMod", "Mod")


def _sign(torch_expr: Expr, expr: Expr, ranges: dict | None) -> int | None:
    """1 where `expr` (torch's `torch_expr`) is never negative, -1 where never positive, else None:
    from sympy's assumptions (every symbol a non-negative integer), else the ShapeEnv's ranges."""
    if expr.is_nonnegative:
        return 1
    if expr.is_nonpositive:
        return -1
    if ranges is not None:
        try:
            from torch.utils._sympy.value_ranges import bound_sympy

            bound = bound_sympy(torch_expr, ranges)
        except (TypeError, ValueError, KeyError, AttributeError, NotImplementedError):  # a function it cannot bound
            return None
        if bound.lower >= 0:
            return 1
        if bound.upper <= 0:
            return -1
    return None


def _rounded_true_division(expr: Expr, ranges: dict | None) -> Expr | None:
    """`math.floor(n / b)`, `int(n / b)` and `math.ceil(n / b)` over sizes (torch's FloorToInt,
    TruncToInt or CeilToInt of an IntTrueDiv by a positive integer) as integer divisions; None for any
    other expression."""
    kind = type(expr).__name__
    if kind not in ("FloorToInt", "TruncToInt", "CeilToInt") or len(expr.args) != 1:
        return None
    inner = expr.args[0]
    if type(inner).__name__ != "IntTrueDiv" or not (inner.args[1].is_Integer and inner.args[1] > 0):
        return None
    a = _converted(inner.args[0], ranges)
    b = inner.args[1]
    sign = _sign(inner.args[0], a, ranges)
    if kind == "TruncToInt" and sign is not None:
        kind = "FloorToInt" if sign > 0 else "CeilToInt"
    if kind == "FloorToInt":
        return _signed_division("FloorDiv", a, b, sign)
    return _ceil_division(a, b, sign)


def _ceil_division(a: Expr, b: Expr, sign: int | None) -> Expr:
    """ceil(a / b) = -floor(-a / b), in _signed_division's terms (`sign`: `a`'s)."""
    return -_signed_division("FloorDiv", sympy.expand(-a), b, None if sign is None else -sign)


def _signed_division(kind: str, a: Expr, b: Expr, sign: int | None) -> Expr:
    """torch's FloorDiv or Python modulo of `a` by `b` (`sign`: `a`'s, _sign's) in ember's
    non-negative index functions. The kernels compute `//` and `%` as C does, truncating toward zero,
    which Python's floor division only matches for a non-negative `a`. A numerator that is never
    positive (Python's ceiling division `-(-n // b)`, a padding `-n % b`) is rewritten over its
    negation, which is not negative: floor(-x / b) = -ceil(x / b), and -x mod b = b - 1 - (x + b - 1)
    mod b (no operand negative, where IndexMod's own rules would make (b - x mod b) mod b one). A
    numerator of either sign (`(3 - n) % 8`) is refused: the graph runs eagerly, loudly."""
    if b.is_nonpositive:
        raise TypeError(f"size expression {kind}({a}, {b}) divides by a divisor that is not positive")
    if sign is None:
        raise TypeError(
            f"size expression {kind}({a}, {b}) divides a numerator that may be negative or positive: "
            "ember's kernels divide toward zero, Python's sizes round down"
        )
    if sign < 0 and not a.is_zero:
        x = sympy.expand(-a)
        if kind == "FloorDiv":
            return -IndexDiv(x + b - 1, b)
        return b - 1 - IndexMod(x + b - 1, b)
    return IndexDiv(a, b) if kind == "FloorDiv" else IndexMod(a, b)


_TORCH_INDEX_FUNCTIONS = {
    "ModularIndexing": lambda base, div, mod: IndexMod(IndexDiv(base, div), mod),
    # A stride over a data-dependent size: torch lays out a (2, u0) result with stride max(1, u0).
    "Max": lambda *a: sympy.Max(*a),
    "Min": lambda *a: sympy.Min(*a),
}


def product(sizes: Iterable[Expr]) -> Expr:
    """The product of `sizes`; static ones multiplied as Python integers (sympy's Integer product
    is a hundred times slower, and scheduling a large graph takes many thousands)."""
    static, symbolic = 1, []
    for size in sizes:
        if isinstance(size, (int, sympy.Integer)):
            static *= int(size)
        else:
            symbolic.append(size)
    return functools.reduce(lambda a, b: a * b, symbolic, sympy.Integer(static))


def contiguous_strides(shape: tuple[Expr, ...]) -> tuple[Expr, ...]:
    strides = []
    running: Expr = sympy.Integer(1)
    for size in reversed(shape):
        strides.append(running)
        running = running * size
    return tuple(reversed(strides))


def is_static(e: Expr) -> bool:
    return not e.free_symbols


@functools.lru_cache(maxsize=1 << 16)
def affine_split(expr: Expr, var: sympy.Symbol) -> tuple[Expr, Expr] | None:
    """(c, rest) with expr == c*var + rest and neither c nor rest using var; None if not affine in var.
    Kept: fusion rebuilds a kernel per candidate merge, splitting the same index expressions."""
    expr = sympy.expand(expr)
    if not expr.has(var):
        return sympy.Integer(0), expr
    coeff = expr.coeff(var, 1)
    rest = expr.coeff(var, 0)
    if coeff.has(var) or rest.has(var) or sympy.expand(coeff * var + rest - expr) != 0:
        return None
    return coeff, rest


def pow2_ceil(x: int) -> int:
    """The least power of two at or above x (1 for x <= 1): Triton's block sizes."""
    return 1 << max(0, (max(x, 1) - 1).bit_length())
