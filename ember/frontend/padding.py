"""Matrix-product layouts cuBLAS runs fast: rows padded to 16 bytes.

cuBLAS picks its fast kernels only when every operand's leading dimension is a multiple of 16
bytes. A GPT-2 head writes logits of 50257 columns: with rows 50257 elements apart it falls back
to an `align1` kernel, 7x slower on the H100 (6.6 ms against 0.9 ms for the same product).
PyTorch's eager mode pays that too; Inductor pads (its `pad_mm`).

ember pads by layout, never by copying: a product's result is written by `mm.out` / `addmm.out`
into rows padded to 16 bytes (the logical shape is unchanged, the row stride is larger), and a
matrix ember computes itself that a product reads, or reads transposed, is laid out with padded
rows from the start. Kernels index any layout, so no one else notices. Values a training graph
returns stay dense: AOTAutograd recorded their strides for the backward graph.
"""

from __future__ import annotations

import sympy
import torch

from ember.ir.graph import Graph, Node, Value
from ember.ir.sizes import contiguous_strides

aten = torch.ops.aten

_ALIGN_BYTES = 16
_MIN_ELEMENTS = 1 << 16  # small products are launch-bound: not worth a layout change
PAD_ON = ("cuda",)  # device types whose BLAS wants aligned rows (tests add "cpu" to exercise it)
_PRODUCTS = {aten.mm.default: aten.mm.out, aten.addmm.default: aten.addmm.out}
_COMPUTED = ("pointwise", "cast", "reduce", "full", "iota")


class IntoPadded:
    """An extern target: the product written into a buffer with padded rows."""

    def __init__(self, out_op, size: tuple[int, int], stride: tuple[int, int]):
        self.out_op, self.size, self.stride = out_op, size, stride
        self.__name__ = f"{out_op.__name__} into rows of {stride[0]}"

    def __call__(self, *args, **kwargs):
        like = args[-1]
        out = torch.empty_strided(self.size, self.stride, dtype=like.dtype, device=like.device)
        return self.out_op(*args, **kwargs, out=out)


def pad_matmul_layouts(graph: Graph, keep_outputs_dense: bool) -> list[str]:
    """Pad product results and the computed matrices products read; returns what was padded."""
    if graph.device.type not in PAD_ON:
        return []
    pinned = {o for o in graph.outputs if isinstance(o, Value)} if keep_outputs_dense else set()
    notes = []
    for node in graph.nodes:
        if node.op != "extern" or node.attrs["target"] not in _PRODUCTS or node.attrs["kwargs"]:
            continue
        out = node.out
        padded = _padded_row(out)
        if padded is not None and out not in pinned and tuple(out.stride) == tuple(contiguous_strides(out.shape)):
            size = (int(out.shape[0]), int(out.shape[1]))
            node.attrs["target"] = IntoPadded(_PRODUCTS[node.attrs["target"]], size, (padded, 1))
            out.stride = (sympy.Integer(padded), sympy.Integer(1))
            notes.append(f"{node.origin} -> %{out.name}: rows padded to {padded}")
        for operand in _matrix_operands(node):
            base = _computed_base(operand)
            if base is None or base in pinned:
                continue
            padded = _padded_row(base)
            if padded is not None:
                base.stride = (sympy.Integer(padded), sympy.Integer(1))
                notes.append(f"%{base.name} (read by {node.origin}): rows padded to {padded}")
    return notes


def _padded_row(v: Value) -> int | None:
    """The padded row length of a 2-D row-major matrix whose rows are not 16-byte aligned."""
    if len(v.shape) != 2 or not all(sympy.sympify(s).is_Integer for s in v.shape):
        return None
    if v.stride is not None and tuple(v.stride) != tuple(contiguous_strides(v.shape)):
        return None
    rows, cols = int(v.shape[0]), int(v.shape[1])
    per = max(1, _ALIGN_BYTES // v.dtype.itemsize)
    if rows * cols < _MIN_ELEMENTS or cols % per == 0 or rows == 1:
        return None
    return -(-cols // per) * per


def _matrix_operands(node: Node) -> list[Value]:
    args = node.attrs["args"]
    operands = args[-2:]  # mm(a, b), addmm(bias, a, b)
    return [a for a in operands if isinstance(a, Value)]


def _computed_base(v: Value) -> Value | None:
    """The value ember computes whose layout decides this operand's: itself, or what it transposes."""
    if v.node.op in _COMPUTED and v.stride is None:
        return v
    if v.node.op == "view" and v.node.attrs.get("kind") == "permute" and len(v.shape) == 2:
        (base,) = v.node.inputs
        if base.node.op in _COMPUTED and base.stride is None:
            return base
    return None


__all__ = ["IntoPadded", "pad_matmul_layouts"]
