"""FlexAttention's score and mask programs (ir/flex.py) printed as statements of a kernel, in Triton
or C++. Pointwise ops render through ir/ops.py's table; casts, constants, loads from captured tensors
and the two integer ops outside the table are written here. The caller names the arguments (score,
b, h, q_idx, kv_idx as the kernel holds them) and says how a captured tensor's element is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ember.ir.flex import FlexProgram
from ember.ir.ops import POINTWISE

CPP_TYPES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.int32: "int32_t",
    torch.int64: "int64_t",
    torch.int16: "int16_t",
    torch.int8: "int8_t",
    torch.uint8: "uint8_t",
    torch.bool: "bool",
    torch.bfloat16: "uint16_t",
    torch.float16: "_Float16",
}
TRITON_TYPES = {
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
    torch.int16: "tl.int16",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
    torch.bfloat16: "tl.bfloat16",
    torch.float16: "tl.float16",
}

_EXTRA = {
    "cpp": {
        "floordiv": "ember_floordiv({0}, {1})",
        "remainder": "ember_remainder({0}, {1})",
    },
    "triton": {
        "floordiv": "ember_floordiv({0}, {1})",
        "remainder": "ember_remainder({0}, {1})",
    },
}

# Helpers the programs' integer ops call, per language (Python's rounding: toward -inf).
CPP_HELPERS = r"""
template <class T> static inline T ember_floordiv(T a, T b) {
    T q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
template <class T> static inline T ember_remainder(T a, T b) {
    T r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
static inline float ember_remainder(float a, float b) { float r = std::fmod(a, b); return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
static inline double ember_remainder(double a, double b) { double r = std::fmod(a, b); return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
"""
TRITON_HELPERS = """
@triton.jit
def ember_floordiv(a, b):
    q = a // b
    return tl.where((q * b != a) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def ember_remainder(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
"""


def _constant(value, dtype: torch.dtype, lang: str) -> str:
    if dtype == torch.bool:
        return ("true" if value else "false") if lang == "cpp" else ("1" if value else "0")
    if dtype.is_floating_point:
        value = float(value)
        if math.isnan(value):
            return "NAN" if lang == "cpp" else 'float("nan")'
        if math.isinf(value):
            sign = "-" if value < 0 else ""
            return f"{sign}INFINITY" if lang == "cpp" else f'{sign}float("inf")'
        text = repr(value)
        return f"{text}f" if lang == "cpp" and dtype == torch.float32 else text
    return str(int(value))


def render_program(
    program: FlexProgram,
    lang: str,
    args: dict[int, str],
    load: Callable[[int, list[str]], str],
    prefix: str,
    interpreted: bool = False,
) -> tuple[list[str], str]:
    """The statements computing `program` and the name of its result. `args`: argument number ->
    the kernel's expression for it; `load(buffer, indices)` -> an expression reading one element."""
    lines: list[str] = []
    names: list[str] = []
    for i, n in enumerate(program.nodes):
        name = f"{prefix}{i}"
        ops = [names[j] for j in n.inputs]
        if n.op == "arg":
            expr = args[n.attr]
        elif n.op == "const":
            expr = _constant(n.attr, n.dtype, lang)
        elif n.op == "load":
            expr = load(n.attr, ops)
        elif n.op == "cast":
            expr = _cast(ops[0], program.nodes[n.inputs[0]].dtype, n.dtype, lang)
        elif n.op in _EXTRA[lang]:
            expr = _EXTRA[lang][n.op].format(*ops)
        else:
            op = POINTWISE[n.op]
            fmt = op.triton if lang == "triton" else op.cpp
            if lang == "triton" and interpreted and op.triton_interpreted is not None:
                fmt = op.triton_interpreted
            expr = fmt.format(*ops)
        if lang == "cpp":
            lines.append(f"const {CPP_TYPES[n.dtype]} {name} = {expr};")
        else:
            lines.append(f"{name} = {expr}")
        names.append(name)
    return lines, names[program.result]


def hoist(program: FlexProgram, lines: list[str], invariant_args: set[int]) -> tuple[list[str], list[str]]:
    """`lines` (render_program's, one per node) split into those computing what depends only on the
    arguments `invariant_args` and constants (a captured table read by head: ALiBi's slope), which a
    kernel computes once before its loop, and the rest, which it computes per step."""
    invariant = program.invariant(invariant_args)
    before = [line for line, inv in zip(lines, invariant) if inv]
    return before, [line for line, inv in zip(lines, invariant) if not inv]


def _cast(x: str, src: torch.dtype, dst: torch.dtype, lang: str) -> str:
    if lang == "cpp":
        if dst == torch.bool:
            return f"({x} != 0)"
        if src == torch.bfloat16:
            return f"static_cast<{CPP_TYPES[dst]}>(ember_bf16_to_f32({x}))"
        if dst == torch.bfloat16:
            raise NotImplementedError("a flex_attention function casting to bfloat16")
        return f"static_cast<{CPP_TYPES[dst]}>({x})"
    if dst == torch.bool:
        return f"({x} != 0)"
    return f"({x}).to({TRITON_TYPES[dst]})"


__all__ = ["CPP_HELPERS", "CPP_TYPES", "TRITON_HELPERS", "TRITON_TYPES", "hoist", "render_program"]
