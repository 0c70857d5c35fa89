"""Runtime checks on sizes: AOTAutograd's `_assert_scalar` on a condition over symbolic sizes.

A size that depends on data (`nonzero`'s row count, a boolean mask's length: an unbacked symbol
`u0`) comes with checks Dynamo records (`u0 <= 16`; `sym_constrain_range_for_size` where a torch
version records that). The importer turns the condition (a SymBool) into a sympy relation over
ember's size symbols; one that sympy proves (`u0 >= 0`, sizes are non-negative) vanishes, and any
other is checked by the host program once the values carrying its symbols exist (they are the
check's operands, so the schedule orders it after them; the host program refuses at compile time a
step that would read a size before it is bound).
"""

from __future__ import annotations

import sympy
import torch

from ember.aten.builder import GraphBuilder
from ember.aten.registry import GraphUnsupported, Unsupported, lowering

aten = torch.ops.aten


class SizeCheck:
    """An extern target: raise eager's message when a condition over sizes does not hold. The values
    after the condition only order the call after the ones that bind its symbols."""

    def __init__(self, message: str):
        self.message = message
        self.__name__ = "size_check"

    def __call__(self, holds: bool, *carriers) -> None:
        if not holds:
            raise RuntimeError(self.message)


@lowering(aten._assert_scalar)
def _assert_scalar(ctx: GraphBuilder, node):
    message = str(node.args[1]) if len(node.args) > 1 else "a runtime assertion on sizes failed"
    _check(ctx, ctx.arg(node.args[0]), message)


@lowering(aten.sym_constrain_range_for_size, aten.sym_constrain_range)
def _constrain_range(ctx: GraphBuilder, node):
    """`torch._check_is_size` and range constraints on a size: min <= size <= max, as a check."""
    size = ctx.arg(node.args[0])
    if not isinstance(size, sympy.Expr):
        raise Unsupported("a range constraint on a value that is not a size")
    low, high = node.kwargs.get("min"), node.kwargs.get("max")
    parts = [size >= (0 if low is None else low)] + ([size <= high] if high is not None else [])
    _check(ctx, sympy.And(*parts), f"{size} is not within [{low}, {high}]")


def _check(ctx: GraphBuilder, condition, message: str) -> None:
    if condition is True or condition == sympy.true:
        return
    if condition is False or condition == sympy.false:
        raise GraphUnsupported(f"a size check that always fails: {message}")
    if not isinstance(condition, sympy.logic.boolalg.Boolean) or isinstance(condition, sympy.Symbol):
        raise Unsupported("an assertion on a value that is not a condition over sizes")
    carriers = []
    for symbol in sorted(condition.free_symbols, key=str):
        carrier = next((v for v in ctx.graph.values() if any(symbol in _symbols(e) for e in _sizes(v))), None)
        if carrier is not None and carrier not in carriers:
            carriers.append(carrier)
    ctx.extern_call(SizeCheck(message), (condition, *carriers), {}, None, origin="size check")


def _sizes(v) -> tuple:
    return tuple(v.shape) + tuple(v.stride or ())


def _symbols(e) -> set:
    return getattr(e, "free_symbols", set())
