"""ember's op set.

Pointwise ops are one table: name -> arity, how the result dtype is chosen, reference
semantics (a torch function, used by tests and by the IR interpreter), and the rendering for
each target language. Adding a pointwise op is adding one row here; the frontend maps ATen
ops onto these names and the code generators look the rendering up, so no stage grows an
`if op == ...` chain.

The other op families (reductions, views, sources, externs) have their own small records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PointwiseOp:
    name: str
    arity: int
    torch_fn: Callable
    triton: str  # format string over the operands {0}, {1}, ...
    cpp: str
    # "arith": operands are converted to the result's compute dtype.
    # "compare": operands are converted to their promoted dtype; the result is bool.
    # "select": where(cond, a, b): operand 0 is bool, the others take the result dtype.
    kind: str = "arith"
    flops: int = 1
    # Triton's CPU interpreter (used by the tests) lacks libdevice; None means "same as triton".
    triton_interpreted: str | None = None


POINTWISE: dict[str, PointwiseOp] = {}


def _op(name, arity, torch_fn, triton, cpp, kind="arith", flops=1, interpreted=None):
    POINTWISE[name] = PointwiseOp(name, arity, torch_fn, triton, cpp, kind, flops, interpreted)


# Arithmetic.
_op("add", 2, torch.add, "({0} + {1})", "({0} + {1})")
_op("sub", 2, torch.sub, "({0} - {1})", "({0} - {1})")
_op("mul", 2, torch.mul, "({0} * {1})", "({0} * {1})")
_op("truediv", 2, torch.div, "({0} / {1})", "({0} / {1})")
_op("neg", 1, torch.neg, "(-{0})", "(-{0})")
_op("abs", 1, torch.abs, "tl.abs({0})", "std::abs({0})")
_op("maximum", 2, torch.maximum, "ember_maximum({0}, {1})", "ember_maximum({0}, {1})")
_op("minimum", 2, torch.minimum, "ember_minimum({0}, {1})", "ember_minimum({0}, {1})")
_op("reciprocal", 1, torch.reciprocal, "(1.0 / {0})", "(1 / {0})")
# Transcendental (float only; the frontend sends integer inputs to externs).
_op("exp", 1, torch.exp, "tl.exp({0})", "std::exp({0})", flops=4)
_op("exp2", 1, torch.exp2, "tl.exp2({0})", "std::exp2({0})", flops=4)
_op("expm1", 1, torch.expm1, "libdevice.expm1({0})", "std::expm1({0})", flops=4, interpreted="(tl.exp({0}) - 1.0)")
_op("log", 1, torch.log, "tl.log({0})", "std::log({0})", flops=4)
_op("log1p", 1, torch.log1p, "libdevice.log1p({0})", "std::log1p({0})", flops=4, interpreted="tl.log(1.0 + {0})")
_op("log2", 1, torch.log2, "tl.log2({0})", "std::log2({0})", flops=4)
_op("sqrt", 1, torch.sqrt, "tl.sqrt({0})", "std::sqrt({0})", flops=4)
_op("rsqrt", 1, torch.rsqrt, "tl.rsqrt({0})", "(1 / std::sqrt({0}))", flops=4)
_op(
    "tanh",
    1,
    torch.tanh,
    "libdevice.tanh({0})",
    "std::tanh({0})",
    flops=8,
    interpreted="(2.0 * tl.sigmoid(2.0 * {0}) - 1.0)",
)
_op("sigmoid", 1, torch.sigmoid, "tl.sigmoid({0})", "(1 / (1 + std::exp(-{0})))", flops=8)
_op("erf", 1, torch.erf, "tl.erf({0})", "std::erf({0})", flops=8)
_op("sin", 1, torch.sin, "tl.sin({0})", "std::sin({0})", flops=8)
_op("cos", 1, torch.cos, "tl.cos({0})", "std::cos({0})", flops=8)
_op("pow", 2, torch.pow, "libdevice.pow({0}, {1})", "std::pow({0}, {1})", flops=8, interpreted="ember_pow({0}, {1})")
_op("floor", 1, torch.floor, "tl.floor({0})", "std::floor({0})")
_op("ceil", 1, torch.ceil, "tl.ceil({0})", "std::ceil({0})")
# Comparisons and logic.
_op("eq", 2, torch.eq, "({0} == {1})", "({0} == {1})", kind="compare")
_op("ne", 2, torch.ne, "({0} != {1})", "({0} != {1})", kind="compare")
_op("lt", 2, torch.lt, "({0} < {1})", "({0} < {1})", kind="compare")
_op("le", 2, torch.le, "({0} <= {1})", "({0} <= {1})", kind="compare")
_op("gt", 2, torch.gt, "({0} > {1})", "({0} > {1})", kind="compare")
_op("ge", 2, torch.ge, "({0} >= {1})", "({0} >= {1})", kind="compare")
_op("isnan", 1, torch.isnan, "({0} != {0})", "({0} != {0})", kind="compare")
_op("logical_not", 1, torch.logical_not, "({0} == 0)", "(!{0})", kind="compare")
# C++ as Triton: `&` and `|`, not `&&` and `||`, whose short circuit GCC 12 keeps as a branch where the
# operands do not change along a vector loop (a window position inside the image), leaving it scalar.
# (Triton's interpreter cannot `&` a block of booleans with a scalar one, as a 0-dim tensor's load gives:
# it combines them as bytes.)
_op(
    "logical_and",
    2,
    torch.logical_and,
    "(({0} != 0) & ({1} != 0))",
    "(({0} != 0) & ({1} != 0))",
    kind="compare",
    interpreted="((({0} != 0).to(tl.int8) & ({1} != 0).to(tl.int8)) != 0)",
)
_op(
    "logical_or",
    2,
    torch.logical_or,
    "(({0} != 0) | ({1} != 0))",
    "(({0} != 0) | ({1} != 0))",
    kind="compare",
    interpreted="((({0} != 0).to(tl.int8) | ({1} != 0).to(tl.int8)) != 0)",
)
_op("bitwise_and", 2, torch.bitwise_and, "({0} & {1})", "({0} & {1})")
_op("bitwise_or", 2, torch.bitwise_or, "({0} | {1})", "({0} | {1})")
_op("where", 3, torch.where, "tl.where({0}, {1}, {2})", "({0} ? {1} : {2})", kind="select")
# Ops that only float inputs may reach (integer forms differ or are undefined).
FLOAT_ONLY = frozenset(
    n
    for n in POINTWISE
    if n
    in {
        "truediv",
        "reciprocal",
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "log2",
        "sqrt",
        "rsqrt",
        "tanh",
        "sigmoid",
        "erf",
        "sin",
        "cos",
        "pow",
        "floor",
        "ceil",
    }
)

REDUCTIONS = ("sum", "max", "min", "prod")
