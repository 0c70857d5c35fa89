"""cat, constant_pad_nd and slice_backward: selections among clamped (replicate_pad) views, so that
they fuse with their producers and readers instead of copying through memory.
"""

from __future__ import annotations

import torch

from ember.aten.builder import GraphBuilder, ShapeDtype
from ember.aten.lowerings.movement import clamp_index
from ember.aten.lowerings.positions import padded_view, position_along
from ember.aten.registry import Unsupported, lowering, lowering_for
from ember.ir.graph import Value
from ember.ir.sizes import as_expr

aten = torch.ops.aten

# cat and constant padding both become one pointwise value: position p along the dim picks the piece whose range holds
# it, `where(p < end_0, piece_0, where(p < end_1, piece_1, ...))`, each piece read through a
# `replicate_pad` view (ir/views.py) so that every read is in bounds. The result fuses like any
# pointwise value: LLaMA's rotate_half (`cat(-x2, x1)`) becomes index math inside the RoPE
# kernel instead of a copy through memory. Every piece is evaluated at every position (a select,
# not a branch), so the number of pieces is bounded; more run as ATen's cat.
MAX_CAT_PIECES = 8


@lowering(aten.cat)
def _cat(ctx: GraphBuilder, node):
    out = ctx.out_meta()
    rank = out.dim()
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % max(rank, 1)
    tensors = [ctx.arg(t) for t in node.args[0]]
    if not all(isinstance(t, Value) for t in tensors):
        raise Unsupported("cat operands")
    return _joined(ctx, node, tensors, dim)


@lowering(aten.stack)
def _stack(ctx: GraphBuilder, node):
    """stack as cat along a new dim: an attention backward's dq, dk and dv stacked into the gradient of
    a packed qkv projection fuse with the kernel that lays them out for its product."""
    out = ctx.out_meta()
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.dim()
    tensors = [ctx.arg(t) for t in node.args[0]]
    if not tensors or not all(isinstance(t, Value) for t in tensors):
        raise Unsupported("stack operands")
    return _joined(ctx, node, [ctx.view("unsqueeze", t, dim=dim) for t in tensors], dim)


def _joined(ctx: GraphBuilder, node, tensors: list[Value], dim: int) -> Value:
    """`tensors` joined along `dim` into the node's result, as one select among the pieces."""
    out = ctx.out_meta()
    rank = out.dim()
    # cat skips legacy empty 1-D tensors ([0]) whatever the rank, and adds nothing for empty pieces.
    pieces = [t for t in tensors if len(t.shape) == rank and not (t.shape[dim].is_Integer and int(t.shape[dim]) == 0)]
    if not pieces or rank == 0:
        raise Unsupported("cat of empty pieces")
    if len(pieces) > MAX_CAT_PIECES:
        raise Unsupported(f"cat of {len(pieces)} pieces (at most {MAX_CAT_PIECES} fuse)")
    if not any(_computed(p) for p in pieces) and not _feeds_a_kernel(node):
        # Buffers in, a buffer out for an extern: nothing to fuse, and ATen's copy (one pass per
        # piece, no select) is as fast as a copy gets.
        raise Unsupported("cat of buffers into an extern: ATen's copy")
    shape = tuple(as_expr(s) for s in out.shape)
    length = shape[dim]
    position = position_along(ctx, ShapeDtype(shape, torch.int64), dim)
    starts = [as_expr(0)]
    for p in pieces[:-1]:
        starts.append(starts[-1] + p.shape[dim])
    result = None
    for piece, start in reversed(list(zip(pieces, starts))):
        piece = ctx.cast(piece, out.dtype)
        spread = ctx.view("replicate_pad", piece, dim=dim, before=start, length=length)
        if result is None:
            result = spread
            continue
        inside = ctx.pointwise("lt", [position, start + piece.shape[dim]], ShapeDtype(position.shape, torch.bool))
        result = ctx.pointwise("where", [inside, spread, result], out)
    if result.node.op == "view" or result.node.op == "input":
        result = ctx.pointwise("mul", [result, 1], out)  # cat returns a new tensor, never an alias
    return result


def _computed(x: Value) -> bool:
    """Whether x (through views) is computed by ember's kernels, so it could fuse with its reader."""
    while x.node.op == "view":
        x = x.node.inputs[0]
    return x.node.op not in ("input", "extern")


_MOVEMENT = {aten.view, aten.reshape, aten._unsafe_view, aten.permute, aten.transpose, aten.t, aten.expand}


def _feeds_a_kernel(node) -> bool:
    """Whether some reader of the FX node (through views) is an op ember lowers into kernels."""
    frontier = list(node.users)
    while frontier:
        user = frontier.pop()
        packet = getattr(user.target, "overloadpacket", None)
        if packet in _MOVEMENT:
            frontier.extend(user.users)
        elif user.op == "call_function" and lowering_for(user.target) is not None:
            return True
    return False


@lowering(aten.constant_pad_nd)
def _constant_pad_nd(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    value = ctx.arg(node.args[2]) if len(node.args) > 2 else node.kwargs.get("value", 0)
    if not isinstance(x, Value) or not isinstance(value, (int, float, bool)):
        raise Unsupported("constant_pad_nd operands")
    out = ctx.out_meta()
    if any(s == 0 for s in out.shape) or any(s == 0 for s in x.shape):
        raise Unsupported("constant_pad_nd of an empty tensor")
    pads = [as_expr(ctx.arg(p)) for p in node.args[1]]
    if all(p == 0 for p in pads) and _read_by_convolutions_only(node):
        return x  # a pad of zero widths (TF-style "same" padding that came out to none) copies nothing
    widths = {len(x.shape) - 1 - k: (pads[2 * k], pads[2 * k + 1]) for k in range(len(pads) // 2)}
    result, inside = padded_view(ctx, x, widths, tuple(as_expr(s) for s in out.shape))
    if inside is None:
        return ctx.pointwise("mul", [result, 1], out)  # only crops: a copy of the slice
    return ctx.pointwise("where", [inside, result, value], out)


def _read_by_convolutions_only(node) -> bool:
    """Whether every reader of `node` is a convolution, whose result is a new tensor: then `node`
    sharing its input's storage is seen by no one. (A pad that is returned, or a view of it, or a
    pad of an input returned through a view, must stay a new tensor, as eager's is.)"""
    return bool(node.users) and all(user.target is aten.convolution.default for user in node.users)


@lowering(aten.slice_backward)
def _slice_backward(ctx: GraphBuilder, node):
    """The gradient of x[start:end] along dim: grad placed in zeros of x's shape. With step 1 that
    is grad padded by zeros, which fuses into its reader (LLaMA's rotate_half backward: the two
    halves' gradients meet in one add) instead of ATen's fill and copy per half."""
    grad = ctx.arg(node.args[0])
    out = ctx.out_meta()
    rank = out.dim()
    dim, start, _end, step = (ctx.arg(a) for a in node.args[2:6])
    if not isinstance(grad, Value) or step != 1 or rank == 0 or any(s == 0 for s in grad.shape):
        raise Unsupported("slice_backward with a step or an empty gradient")
    dim %= rank
    shape = tuple(as_expr(s) for s in out.shape)
    before = clamp_index(start, shape[dim])  # as the forward slice clamped it; end is start + len
    after = shape[dim] - before - grad.shape[dim]
    result, inside = padded_view(ctx, ctx.cast(grad, out.dtype), {dim: (before, after)}, shape)
    if inside is None:
        return ctx.pointwise("mul", [result, 1], out)  # the slice was the whole dim: a copy
    return ctx.pointwise("where", [inside, result, 0], out)
