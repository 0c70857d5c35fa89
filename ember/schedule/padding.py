"""Matrix products cuBLAS runs fast: N padded to 16 bytes, and rows padded to match.

cuBLAS picks its vectorized kernels only when the matrices' contiguous extents and leading
dimensions are multiples of 16 bytes. A GPT-2 head has N = 50257 vocabulary columns: cuBLAS
falls back to an `align1` kernel, 7x slower on the H100 (6.6 ms against 0.9 ms). Eager PyTorch
pays that; Inductor pads (its `pad_mm`).

ember runs every large half- or single-precision product through `AlignedProduct`: an
unaligned N is written into padded rows (the first N8 columns by one aligned product, the last
few by a thin one) and the result is the view of the first N columns; the logical shape is
unchanged, the row stride is larger, and kernels index any layout. An unaligned K (the head's
input gradient, K = 50257) is split into an aligned product plus a thin rank-few update; an
unaligned M that is A's contiguous dim (the head's weight gradient, A = grad_logits.t()) into
two row blocks. Matrices ember computes itself that a product
reads, or reads transposed, are laid out with padded rows, so their leading dimension is aligned.
Values a training graph returns stay dense: AOTAutograd recorded their strides for the backward.

The target's heuristics (ember/target.py: PadHeuristics) say whether products are padded (the
GPU's target: yes) and from what size.
"""

from __future__ import annotations

import sympy
import torch

from ember.ir.graph import COMPUTED_OPS, Graph, Node, Value
from ember.ir.sizes import contiguous_strides
from ember.target import PadHeuristics, Target

aten = torch.ops.aten

_ALIGN_BYTES = 16
_PRODUCTS = (aten.mm.default, aten.addmm.default)
_OUT = {aten.mm.default: aten.mm.out, aten.addmm.default: aten.addmm.out}


class AlignedProduct:
    """An extern target: mm / addmm run so that cuBLAS sees 16-byte aligned extents.

    - N unaligned (`n_pad` given): written into rows `n_pad` apart (the layout promised) by an
      aligned product over the first N8 columns and a thin one over the rest; the result is the
      view of the first N columns.
    - K unaligned: A[:, :K8] @ B[:K8] and then the rank-(K - K8) rest added in place.
    - M unaligned where M is A's contiguous dim (a weight gradient, A = grad.t()): rows [:M8]
      and [M8:] as two products into one output.
    The last two look at the run-time strides. Only the K split changes arithmetic: the order in
    which the K partial sums are added."""

    # Every path returns memory this call allocated (the product, a view of the padded product,
    # or `out`), never an input's: the memory plan may write over the result once it is dead
    # (an epilogue in place) and need not treat the inputs as shared. Without this the plan took
    # the wrapper for a possible view, and on the GPU every GELU after a Linear took a second
    # buffer: hf_bert inference planned 411 MB where eager peaks at 277.
    fresh_result = True

    def __init__(self, op, n: int | None = None, n_pad: int | None = None):
        self.op, self.n, self.n_pad = op, n, n_pad
        padded = f", N padded {n} -> {n_pad}" if n_pad else ""
        self.__name__ = f"{op.__name__} aligned{padded}"

    def __call__(self, *args):
        *bias, a, b = args
        if self.n_pad is not None:
            return self._padded_n(bias, a, b)
        return self._product(bias, a, b)

    def _padded_n(self, bias, a, b):
        """N unaligned: the first N8 columns as one aligned product and the last few as a thin
        one, both written into an output whose rows are `n_pad` apart; the result is the view of
        its first N columns. The weight is read in place: padding it with zero columns instead
        copied it on every call (GPT-2's head: 77 MB, alive beside the 823 MB of logits, so the
        H100 inference peak was 913 MB against eager's 836)."""
        per = _ALIGN_BYTES // a.element_size()
        n8 = self.n // per * per
        out = torch.empty((a.shape[0], self.n_pad), dtype=a.dtype, device=a.device)
        for cols in (slice(0, n8), slice(n8, self.n)):
            if cols.start == cols.stop:
                continue
            part = [bias[0][..., cols] if _per_column(bias[0], self.n) else bias[0]] if bias else []
            self._product(part, a, b[:, cols], out=out[:, cols])
        return out[:, : self.n]

    def _product(self, bias, a, b, out=None):
        """op(*bias, a, b), into `out` when given (any layout BLAS writes in place: rows or
        columns of a larger matrix)."""
        per = _ALIGN_BYTES // a.element_size()
        a, b = _blas_ready(a, per, b.shape[1]), _blas_ready(b, per, a.shape[0])
        m, k = a.shape
        k8, m8 = k // per * per, m // per * per
        if k % per and k8 and a.stride(1) == 1:  # K is A's contiguous dim
            out = self._into(out, bias, a[:, :k8], b[:k8])
            return out.addmm_(a[:, k8:], b[k8:])
        if m % per and m8 and a.stride(0) == 1 and a.stride(1) != 1:  # M is A's contiguous dim
            if out is None:
                out = torch.empty((m, b.shape[1]), dtype=a.dtype, device=a.device)
            for rows in (slice(0, m8), slice(m8, m)):
                part = [bias[0][rows] if bias[0].dim() == 2 and bias[0].shape[0] == m else bias[0]] if bias else []
                _OUT[self.op](*part, a[rows], b, out=out[rows])
            return out
        return self._into(out, bias, a, b)

    def _into(self, out, bias, a, b):
        return self.op(*bias, a, b) if out is None else _OUT[self.op](*bias, a, b, out=out)


def _per_column(bias, n: int) -> bool:
    """Whether an addmm bias has a value per output column (else it broadcasts whole)."""
    return isinstance(bias, torch.Tensor) and bias.dim() >= 1 and bias.shape[-1] == n


def _blas_ready(t: torch.Tensor, per: int, other: int) -> torch.Tensor:
    """t if BLAS can read it in place with an aligned leading dimension, else a copy with padded
    leading dimension in t's own orientation. ATen would copy a zero-stride operand anyway (with
    unaligned rows), and an unaligned leading dimension costs cuBLAS's align1 kernel far more
    than one pass over the operand (a [8192, 50257] gradient: ~0.5 ms copy vs ~3.6 ms lost)."""
    rows, cols = t.shape
    aligned_enough = other < 64  # a matrix-vector-like product: the copy would cost more than it saves
    if t.stride(1) == 1 and t.stride(0) >= max(1, cols) and (t.stride(0) % per == 0 or rows == 1 or aligned_enough):
        return t
    if t.stride(0) == 1 and t.stride(1) >= max(1, rows) and (t.stride(1) % per == 0 or cols == 1 or aligned_enough):
        return t
    if t.stride(0) == 1 and t.stride(1) != 1:  # column-major: keep it so (cuBLAS reads it transposed)
        out = torch.empty_strided((rows, cols), (1, -(-rows // per) * per), dtype=t.dtype, device=t.device)
    else:
        out = torch.empty_strided((rows, cols), (-(-cols // per) * per, 1), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def pad_matmul_layouts(graph: Graph, target: Target, keep_outputs_dense: bool) -> list[str]:
    """Pad products' N and the computed matrices products read, where the target's BLAS wants
    aligned extents (its heuristics' `pad`); returns what was padded."""
    h = target.heuristics.pad
    if not h.products:
        return []
    pinned = {o for o in graph.outputs if isinstance(o, Value)} if keep_outputs_dense else set()
    notes = []
    for node in graph.nodes:
        if node.op != "extern" or node.attrs["target"] not in _PRODUCTS or node.attrs["kwargs"]:
            continue
        out = node.out
        if not _large_static_matrix(out, h):
            continue
        padded = _padded_row(out, h)
        if padded is not None and out not in pinned and tuple(out.stride) == tuple(contiguous_strides(out.shape)):
            node.attrs["target"] = AlignedProduct(node.attrs["target"], int(out.shape[1]), padded)
            out.stride = (sympy.Integer(padded), sympy.Integer(1))
            notes.append(f"{node.origin} -> %{out.name}: N padded to {padded}")
        else:
            node.attrs["target"] = AlignedProduct(node.attrs["target"])
        for operand in _matrix_operands(node):
            base = _computed_base(operand)
            if base is None or base in pinned:
                continue
            padded = _padded_row(base, h)
            if padded is not None:
                _pad_rows(base, padded)
                notes.append(f"%{base.name} (read by {node.origin}): rows padded to {padded}")
    return notes


def _large_static_matrix(v: Value, h: PadHeuristics) -> bool:
    if len(v.shape) != 2 or not all(sympy.sympify(x).is_Integer for x in v.shape):
        return False
    return (
        v.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and int(v.shape[0]) * int(v.shape[1]) >= h.min_elements
    )


def _padded_row(v: Value, h: PadHeuristics) -> int | None:
    """The padded last-dim stride of a row-major value (2-D or more) whose rows are not 16-byte
    aligned, or None."""
    if len(v.shape) < 2 or not all(sympy.sympify(x).is_Integer for x in v.shape):
        return None
    if v.stride is not None and tuple(v.stride) != tuple(contiguous_strides(v.shape)):
        return None
    cols = int(v.shape[-1])
    rows = 1
    for x in v.shape[:-1]:
        rows *= int(x)
    per = max(1, _ALIGN_BYTES // v.dtype.itemsize)
    if rows * cols < h.min_elements or cols % per == 0 or rows == 1 or cols < 8 * per:
        return None  # short rows (a pooled [N, C, 1, 1]) would grow by more than they gain
    return -(-cols // per) * per


def _pad_rows(v: Value, row: int) -> None:
    """Lay v out row-major with its last dim `row` elements apart."""
    strides, step = [], sympy.Integer(row)
    for size in reversed(v.shape[:-1]):
        strides.append(step)
        step = step * size
    v.stride = (*reversed(strides), sympy.Integer(1))


def _matrix_operands(node: Node) -> list[Value]:
    args = node.attrs["args"]
    operands = args[-2:]  # mm(a, b), addmm(bias, a, b)
    return [a for a in operands if isinstance(a, Value)]


def _computed_base(v: Value) -> Value | None:
    """The value ember computes whose layout decides this operand's: itself, or the value it is
    a view of (a transpose, or a reshape of [B, T, N] logits' gradient to [B*T, N])."""
    while v.node.op == "view":
        (v,) = v.node.inputs
    if v.node.op in COMPUTED_OPS and v.stride is None:
        return v
    return None


__all__ = ["AlignedProduct", "pad_matmul_layouts"]
