"""Movement ops: view, reshape, permute, transpose, expand, slice, select, (un)squeeze, split and
aliases, each a view of its input (ir/views.py): index math in the kernels that read it, never a
copy of its own.
"""

from __future__ import annotations

import torch

from ember.aten.builder import GraphBuilder
from ember.aten.registry import Unsupported, lowering
from ember.ir.sizes import as_expr

aten = torch.ops.aten


@lowering(aten.view, aten._unsafe_view, aten.reshape)
def _view(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    if not hasattr(x, "shape") or not isinstance(node.args[1], (list, tuple)):
        raise Unsupported("view(dtype)")
    return ctx.reshape(x, [as_expr(s) for s in ctx.out_meta().shape])


@lowering(aten.permute)
def _permute(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    rank = len(x.shape)
    return ctx.view("permute", x, dims=tuple(d % rank for d in node.args[1]))


@lowering(aten.t, aten.transpose)
def _transpose(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    rank = len(x.shape)
    if rank < 2:
        return x
    a, b = (node.args[1] % rank, node.args[2] % rank) if len(node.args) > 2 else (0, 1)
    dims = list(range(rank))
    dims[a], dims[b] = dims[b], dims[a]
    return ctx.view("permute", x, dims=tuple(dims))


@lowering(aten.expand)
def _expand(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    shape = tuple(as_expr(s) for s in ctx.out_meta().shape)
    if shape == tuple(x.shape):
        return x  # expand to its own shape (e.g. a 0-d tensor to ()) is the identity
    return ctx.view("expand", x, shape=shape)


@lowering(aten.slice)
def _slice(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    args = list(node.args) + [None] * (5 - len(node.args))
    dim = (args[1] if args[1] is not None else node.kwargs.get("dim", 0)) % len(x.shape)
    step = args[4] if args[4] is not None else node.kwargs.get("step", 1)
    start = args[2] if args[2] is not None else node.kwargs.get("start")
    out_len = as_expr(ctx.out_meta().shape[dim])
    size = x.shape[dim]
    start = clamp_index(ctx.arg(start) if start is not None else 0, size)
    end = start + out_len * step
    return ctx.view("slice", x, dim=dim, start=start, end=end, step=as_expr(step))


def clamp_index(i, size):
    """A slice's start as eager clamps it into [0, size] (a negative one counts from the end)."""
    i = as_expr(i)
    if i.is_Integer and size.is_Integer:
        v = int(i)
        v = v + int(size) if v < 0 else v
        return as_expr(min(max(v, 0), int(size)))
    if i.is_Integer and int(i) < 0:
        raise Unsupported("negative symbolic slice start")
    return i


@lowering(aten.select)
def _select(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    dim = node.args[1] % len(x.shape)
    index = as_expr(ctx.arg(node.args[2]))
    if index.is_Integer and int(index) < 0:
        index = x.shape[dim] + index
    return ctx.view("select", x, dim=dim, index=index)


@lowering(aten.unsqueeze)
def _unsqueeze(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    return ctx.view("unsqueeze", x, dim=node.args[1] % (len(x.shape) + 1))


@lowering(aten.squeeze)
def _squeeze(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    rank = len(x.shape)
    dims = node.args[1] if len(node.args) > 1 else list(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = tuple(sorted(d % rank for d in dims if x.shape[d % rank] == 1)) if rank else ()
    if rank - len(dims) != len(ctx.out_meta().shape):
        # A symbolic size that a guard made 1 (dynamic shapes): ember's expression does not show it.
        raise Unsupported("squeeze of a dim whose size is 1 only by a guard")
    return ctx.view("squeeze", x, dims=dims) if dims else x


@lowering(aten.alias, aten.lift_fresh_copy, aten.detach)
def _alias(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    if node.target.overloadpacket is aten.lift_fresh_copy:
        return ctx.pointwise("mul", [x, 1])
    return x


@lowering(aten.unbind)
def _unbind(ctx: GraphBuilder, node):
    """Each index along a dim as a select view of x: a packed qkv projection's q, k and v (timm's ViT
    unbinds them) stay views of its one buffer, with no ATen call on the host."""
    x = ctx.arg(node.args[0])
    if not x.shape:
        raise Unsupported("unbind of a 0-d tensor")
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(x.shape)
    if not as_expr(x.shape[dim]).is_Integer:
        raise Unsupported("unbind along a symbolic dim")
    return [ctx.view("select", x, dim=dim, index=as_expr(k)) for k in range(int(x.shape[dim]))]


@lowering(aten.split, aten.split_with_sizes)
def _split(ctx: GraphBuilder, node):
    """Pieces along a dim as slice views of x (q/k/v of one projection stay one buffer). The pieces'
    lengths are read off the output meta, so a split size computed from a symbolic length (`chunk`
    under dynamic shapes: ceil(n / 3)) gives each piece its own size expression."""
    x = ctx.arg(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % max(len(x.shape), 1)
    metas = node.meta.get("val")
    if not isinstance(metas, (list, tuple)) or not metas or not all(isinstance(m, torch.Tensor) for m in metas):
        raise Unsupported("split without a result per piece")
    pieces, start = [], as_expr(0)
    for m in metas:
        length = as_expr(m.shape[dim])
        pieces.append(ctx.view("slice", x, dim=dim, start=start, end=start + length, step=as_expr(1)))
        start = start + length
    return pieces
