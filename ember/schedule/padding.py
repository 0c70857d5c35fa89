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

from dataclasses import dataclass

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
    The last two depend on the operands' strides. With static layouts the host program decides
    them when it is written (`specialize`): an aligned product becomes the plain ATen call, and
    only an operand whose layout nothing enforces keeps a stride check per call. Called as is,
    the product looks at the run-time strides. Only the K split changes arithmetic: the order in
    which the K partial sums are added."""

    # Every path returns memory this call allocated (the product, a view of the padded product,
    # or `out`), never an input's: the memory plan may write over the result once it is dead
    # (an epilogue in place) and need not treat the inputs as shared. Without this the plan took
    # the wrapper for a possible view, and on the GPU every GELU after a Linear took a second
    # buffer: hf_bert inference planned 411 MB where eager peaks at 277.
    fresh_result = True
    # The arguments whose strides `specialize` decides from: the two matrices (a bias is sliced
    # the same way whatever its strides).
    layout_args = (-2, -1)

    def __init__(self, op, n: int | None = None, n_pad: int | None = None, dense_operands: bool = False):
        self.op, self.n, self.n_pad = op, n, n_pad
        # The CPU's BLAS reads a row-padded operand's padding (_dense_on_cpu): there a product with
        # such an operand is never the plain ATen call.
        self.dense_operands = dense_operands
        padded = f", N padded {n} -> {n_pad}" if n_pad else ""
        self.__name__ = f"{op.__name__} aligned{padded}"

    def __call__(self, *args):
        *bias, a, b = args
        per = _ALIGN_BYTES // a.element_size()
        cuts = _cuts(self.n, self.n_pad, per, _layout(a), _layout(b))
        return _run(self.op, self.n, self.n_pad, cuts, bias, a, b)

    def specialize(self, layouts: list[tuple | None]):
        """The product for operands of these layouts ((shape, strides, dtype) per argument, None
        where unknown), decided now: the plain ATen op where no cut is needed, else a product
        with its cuts fixed; None where a matrix operand's layout is unknown."""
        a, b = layouts[-2], layouts[-1]
        if a is None or b is None:
            return None
        per = _ALIGN_BYTES // a[2].itemsize
        cuts = _cuts(self.n, self.n_pad, per, a[:2], b[:2])
        padded_operand = self.dense_operands and not (_dense_layout(a[:2]) and _dense_layout(b[:2]))
        if self.n_pad is None and cuts[0][1].plain and not padded_operand:
            return self.op
        return FixedProduct(self, cuts)


class FixedProduct:
    """An AlignedProduct whose cuts were decided from its operands' static layouts: each call runs
    them without looking at a stride."""

    fresh_result = True

    def __init__(self, product: AlignedProduct, cuts: tuple):
        self.op, self.n, self.n_pad, self.cuts = product.op, product.n, product.n_pad, cuts
        self.__name__ = product.__name__

    def __call__(self, *args):
        *bias, a, b = args
        return _run(self.op, self.n, self.n_pad, self.cuts, bias, a, b)


@dataclass(frozen=True)
class _Cut:
    """How one product runs, decided from its operands' shapes and strides."""

    copy_a: tuple[int, int] | None  # strides of an aligned copy of A, or None: A is read in place
    copy_b: tuple[int, int] | None
    k8: int = 0  # K split there: an aligned product, then the rank-(K - k8) rest added in place
    m8: int = 0  # M split there (A column-major): two row blocks into one output

    @property
    def plain(self) -> bool:
        return not (self.copy_a or self.copy_b or self.k8 or self.m8)


def _layout(t: torch.Tensor) -> tuple[tuple, tuple]:
    return tuple(t.shape), t.stride()


def _cuts(n: int | None, n_pad: int | None, per: int, a: tuple, b: tuple) -> tuple:
    """((columns, cut), ...): the whole product, or with N padded its first N8 columns and the rest."""
    (a_shape, a_stride), (b_shape, b_stride) = a, b
    if n_pad is None:
        return ((None, _cut(a_shape, a_stride, b_shape, b_stride, per)),)
    n8 = n // per * per
    pieces = [slice(0, n8), slice(n8, n)]
    return tuple(
        (cols, _cut(a_shape, a_stride, (b_shape[0], cols.stop - cols.start), b_stride, per))
        for cols in pieces
        if cols.start != cols.stop
    )


def _cut(a_shape, a_stride, b_shape, b_stride, per: int) -> _Cut:
    copy_a = _aligned_copy(a_shape, a_stride, per, b_shape[1])
    copy_b = _aligned_copy(b_shape, b_stride, per, a_shape[0])
    a_stride = copy_a or a_stride
    m, k = a_shape
    k8, m8 = k // per * per, m // per * per
    if k % per and k8 and a_stride[1] == 1:  # K is A's contiguous dim
        return _Cut(copy_a, copy_b, k8=k8)
    if m % per and m8 and a_stride[0] == 1 and a_stride[1] != 1:  # M is A's contiguous dim
        return _Cut(copy_a, copy_b, m8=m8)
    return _Cut(copy_a, copy_b)


def _run(op, n: int | None, n_pad: int | None, cuts: tuple, bias: list, a, b):
    """The product by its cuts. N unaligned: both pieces written into an output whose rows are
    `n_pad` apart; the result is the view of its first N columns. The weight is read in place:
    padding it with zero columns instead copied it on every call (GPT-2's head: 77 MB, alive
    beside the 823 MB of logits, so the H100 inference peak was 913 MB against eager's 836)."""
    if a.device.type == "cpu":
        a, b = _dense_on_cpu(a), _dense_on_cpu(b)
    if n_pad is None:
        return _product(op, cuts[0][1], bias, a, b)
    out = torch.empty((a.shape[0], n_pad), dtype=a.dtype, device=a.device)
    for cols, cut in cuts:
        part = [bias[0][..., cols] if _per_column(bias[0], n) else bias[0]] if bias else []
        _product(op, cut, part, a, b[:, cols], out=out[:, cols])
    return out[:, :n]


def _product(op, cut: _Cut, bias, a, b, out=None):
    """op(*bias, a, b) as `cut` says, into `out` when given (any layout BLAS writes in place:
    rows or columns of a larger matrix)."""
    if cut.copy_a:
        a = torch.empty_strided(a.shape, cut.copy_a, dtype=a.dtype, device=a.device).copy_(a)
    if cut.copy_b:
        b = torch.empty_strided(b.shape, cut.copy_b, dtype=b.dtype, device=b.device).copy_(b)
    if cut.k8:
        k8 = cut.k8
        out = _into(op, out, bias, a[:, :k8], b[:k8])
        return out.addmm_(a[:, k8:], b[k8:])
    if cut.m8:
        m, m8 = a.shape[0], cut.m8
        if out is None:
            out = torch.empty((m, b.shape[1]), dtype=a.dtype, device=a.device)
        for rows in (slice(0, m8), slice(m8, m)):
            part = [bias[0][rows] if bias[0].dim() == 2 and bias[0].shape[0] == m else bias[0]] if bias else []
            _OUT[op](*part, a[rows], b, out=out[rows])
        return out
    return _into(op, out, bias, a, b)


def _dense_layout(layout: tuple) -> bool:
    """Whether a 2-d (shape, strides) lays its rows or its columns next to each other."""
    (m, k), (row, col) = layout
    return (col == 1 and (row == k or m <= 1)) or (row == 1 and (col == m or k <= 1))


def _dense_on_cpu(t):
    """`t` itself where its rows or columns lie next to each other, else a dense copy. The CPU's
    bf16 GEMM (oneDNN) reads a row-padded operand's padding, as far as its blocks reach, and
    multiplies it by the zeros it packs the other operand with: padding that holds NaN or inf bits
    (a padded buffer is never written there) made NaN results. cuBLAS reads only the extents."""
    return t if t.dim() != 2 or _dense_layout(_layout(t)) else t.contiguous()


def _into(op, out, bias, a, b):
    return op(*bias, a, b) if out is None else _OUT[op](*bias, a, b, out=out)


def _per_column(bias, n: int) -> bool:
    """Whether an addmm bias has a value per output column (else it broadcasts whole)."""
    return isinstance(bias, torch.Tensor) and bias.dim() >= 1 and bias.shape[-1] == n


def _aligned_copy(shape: tuple, stride: tuple, per: int, other: int) -> tuple[int, int] | None:
    """None if BLAS can read a matrix of this layout in place with an aligned leading dimension,
    else the strides of a copy with a padded leading dimension in its own orientation. ATen would
    copy a zero-stride operand anyway (with unaligned rows), and an unaligned leading dimension
    costs cuBLAS's align1 kernel far more than one pass over the operand (a [8192, 50257]
    gradient: ~0.5 ms copy vs ~3.6 ms lost)."""
    rows, cols = shape
    aligned_enough = other < 64  # a matrix-vector-like product: the copy would cost more than it saves
    if stride[1] == 1 and stride[0] >= max(1, cols) and (stride[0] % per == 0 or rows == 1 or aligned_enough):
        return None
    if stride[0] == 1 and stride[1] >= max(1, rows) and (stride[1] % per == 0 or cols == 1 or aligned_enough):
        return None
    if stride[0] == 1 and stride[1] != 1:  # column-major: keep it so (cuBLAS reads it transposed)
        return (1, -(-rows // per) * per)
    return (-(-cols // per) * per, 1)


def pad_matmul_layouts(graph: Graph, target: Target, keep_outputs_dense: bool) -> list[str]:
    """Pad products' N and the computed matrices products read, where the target's BLAS wants
    aligned extents (its heuristics' `pad`); returns what was padded."""
    h = target.heuristics.pad
    if not h.products:
        return []
    pinned = {o for o in graph.outputs if isinstance(o, Value)} if keep_outputs_dense else set()
    cpu = target.device == "cpu"
    notes = []
    for node in graph.nodes:
        if node.op != "extern" or node.attrs["target"] not in _PRODUCTS or node.attrs["kwargs"]:
            continue
        out = node.out
        if not _large_static_matrix(out, h):
            continue
        padded = _padded_row(out, h)
        if padded is not None and out not in pinned and tuple(out.stride) == tuple(contiguous_strides(out.shape)):
            node.attrs["target"] = AlignedProduct(node.attrs["target"], int(out.shape[1]), padded, cpu)
            out.stride = (sympy.Integer(padded), sympy.Integer(1))
            notes.append(f"{node.origin} -> %{out.name}: N padded to {padded}")
        else:
            node.attrs["target"] = AlignedProduct(node.attrs["target"], dense_operands=cpu)
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


__all__ = ["AlignedProduct", "FixedProduct", "pad_matmul_layouts"]
