"""gather and scatter with one index per row, as one-hot selections that fuse into the kernel
computing their input, with eager's bounds check on the index.
"""

from __future__ import annotations

import torch

from ember.aten.builder import GraphBuilder, ShapeDtype
from ember.aten.lowerings.positions import position_along
from ember.aten.registry import Unsupported, lowering
from ember.ir.graph import Value
from ember.ir.sizes import as_expr, product

aten = torch.ops.aten

# `x.gather(d, idx)` and `x.scatter(d, idx, v)` with one index per row (idx.size(d) == 1, other
# dims equal to x's) are how losses pick the target class (nll_loss, cross_entropy). As a
# reduction `sum_j where(j == idx, x_j, 0)` and a pointwise `where(j == idx, v, x)` they fuse
# into the kernel that computes x, which then never reaches memory. A one-hot selection never
# reads out of bounds, so an index outside [0, n) would silently select nothing (0); instead each
# gather/scatter checks its index as eager does: `all((idx >= 0) & (idx < n))`, a bool min over
# the (small) index tensor, feeds an `_assert_async` extern that raises RuntimeError on CPU (a
# device-side assert on CUDA, as eager's). The check fuses with any other full reduction over the
# index's elements (cross_entropy's mean over rows reads the targets already), else it is one
# small kernel of its own.


def _one_per_row(x: Value, dim: int, index) -> bool:
    return (
        isinstance(index, Value)
        and len(index.shape) == len(x.shape) > 0
        and index.shape[dim] == 1
        and all(index.shape[d] == x.shape[d] for d in range(len(x.shape)) if d != dim)
        and x.shape[dim] != 0
        and not index.dtype.is_floating_point
    )


def _check_in_range(ctx: GraphBuilder, index: Value, length, dim: int) -> None:
    """Raise at run time, as eager does, when an index lies outside [0, length): eager's gather and
    scatter accept no negative index. The check reads the index once, flattened to one dim so that
    it shares a domain with other full reductions over as many elements."""
    count = product(index.shape)
    if count == 0:
        return
    inside = ShapeDtype(index.shape, torch.bool)
    ok = ctx.pointwise(
        "logical_and",
        [ctx.pointwise("ge", [index, 0], inside), ctx.pointwise("lt", [index, as_expr(length)], inside)],
        inside,
    )
    every = ctx.reduce("min", ctx.reshape(ok, (count,)), [0], False, torch.bool)
    size = f" with size {length}" if as_expr(length).is_Integer else ""
    message = f"{ctx.origin}(): index out of bounds for dimension {dim}{size}"
    ctx.extern_call(aten._assert_async.msg, (every, message), {}, None, origin="_assert_async")


def _select_row(ctx: GraphBuilder, x: Value, dim: int, index: Value, memo: dict) -> Value:
    """x gathered at index along dim, with the gather pushed through pointwise ops and casts so
    that it lands on loads: gather(a - lse) = gather(a) - lse reads a at one point per row."""
    if x.id in memo:
        return memo[x.id]
    rank = len(x.shape)
    out_shape = tuple(1 if d == dim else s for d, s in enumerate(x.shape))
    node = x.node
    if node.op == "pointwise":
        operands = []
        for op in node.inputs:
            if isinstance(op, Value) and len(op.shape) == rank and op.shape[dim] == 1:
                operands.append(op)  # constant along dim: the same at every position
            elif isinstance(op, Value):
                full = op if op.shape == x.shape else ctx.view("expand", op, shape=x.shape)
                operands.append(_select_row(ctx, full, dim, index, memo))
            else:
                operands.append(op)
        attrs = {k: v for k, v in node.attrs.items() if k != "fn"}
        result = ctx.pointwise(node.attrs["fn"], operands, ShapeDtype(out_shape, x.dtype), **attrs)
    elif node.op == "cast":
        result = ctx.cast(_select_row(ctx, node.inputs[0], dim, index, memo), x.dtype)
    else:
        hit = ctx.pointwise("eq", [position_along(ctx, x, dim), index], ShapeDtype(x.shape, torch.bool))
        picked = ctx.pointwise("where", [hit, x, 0], ShapeDtype(x.shape, x.dtype))
        result = ctx.reduce("sum", picked, [dim], True, x.dtype)
    memo[x.id] = result
    return result


@lowering(aten.gather)
def _gather(ctx: GraphBuilder, node):
    x, index = ctx.arg(node.args[0]), ctx.arg(node.args[2])
    if not isinstance(x, Value) or x.dtype == torch.bool or node.kwargs.get("sparse_grad"):
        raise Unsupported("gather operands")
    dim = node.args[1] % max(len(x.shape), 1)
    if not _one_per_row(x, dim, index):
        raise Unsupported("gather of more than one element per row")
    ctx.out_meta()  # the result's dtype and device must be kernel-able
    result = _select_row(ctx, x, dim, index, {})
    _check_in_range(ctx, index, x.shape[dim], dim)
    return result


@lowering(aten.scatter)
def _scatter(ctx: GraphBuilder, node):
    x, index = ctx.arg(node.args[0]), ctx.arg(node.args[2])
    src = ctx.arg(node.args[3]) if len(node.args) > 3 else node.kwargs.get("value", node.kwargs.get("src"))
    if not isinstance(x, Value) or node.kwargs.get("reduce") is not None or len(node.args) > 4:
        raise Unsupported("scatter with reduce")
    dim = node.args[1] % max(len(x.shape), 1)
    if not _one_per_row(x, dim, index):
        raise Unsupported("scatter of more than one element per row")
    if isinstance(src, Value) and tuple(src.shape) != tuple(index.shape):
        raise Unsupported("scatter source shaped unlike the index")
    out = ctx.out_meta()
    hit = ctx.pointwise("eq", [position_along(ctx, x, dim), index], ShapeDtype(x.shape, torch.bool))
    result = ctx.pointwise("where", [hit, src, x], out)
    _check_in_range(ctx, index, x.shape[dim], dim)
    return result
