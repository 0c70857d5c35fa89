"""Values built from positions, shared by the selection lowerings (gather/scatter, cat and padding,
pooling): a position along a dim (an iota), a padded view of a value and where it reads the
value itself. Registers no lowering.
"""

from __future__ import annotations

import torch

from ember.aten.builder import GraphBuilder, ShapeDtype
from ember.ir.graph import Value
from ember.ir.sizes import as_expr


def position_along(ctx: GraphBuilder, x: Value, dim: int) -> Value:
    """j: x's position along dim, shaped to broadcast against x (an iota, never stored)."""
    length = x.shape[dim]
    pos = ctx.iota(length)
    shape = tuple(length if d == dim else 1 for d in range(len(x.shape)))
    return ctx.reshape(pos, shape)


def padded_view(
    ctx: GraphBuilder, x: Value, widths: dict, shape: tuple, masked: bool = True
) -> tuple[Value, Value | None]:
    """x padded by widths {dim: (before, after)} to `shape`, as a replicate_pad view, and a bool
    value (broadcasting to shape) that is True where the view reads x itself: None if everywhere.
    A negative width crops."""
    result, inside = x, None
    for dim, (before, after) in sorted(widths.items()):
        if before == 0 and after == 0:
            continue
        result = ctx.view("replicate_pad", result, dim=dim, before=before, length=shape[dim])
        if not masked:
            continue
        position = position_along(ctx, ShapeDtype(shape, torch.int64), dim)
        checks = []
        if not (before.is_Integer and int(before) <= 0):
            checks.append(ctx.pointwise("ge", [position, before], ShapeDtype(position.shape, torch.bool)))
        if not (after.is_Integer and int(after) <= 0):
            checks.append(
                ctx.pointwise("lt", [position, before + x.shape[dim]], ShapeDtype(position.shape, torch.bool))
            )
        for check in checks:
            inside = check if inside is None else logical_and(ctx, inside, check)
    return result, inside


def logical_and(ctx: GraphBuilder, a: Value, b: Value) -> Value:
    """a & b for bool values shaped as positions along different dims (each dim 1 in one of them)."""
    return ctx.pointwise("logical_and", [a, b], ShapeDtype(broadcast_shapes(a.shape, b.shape), torch.bool))


def broadcast_shapes(a, b) -> tuple:
    """Two shapes of one rank where each dim is 1 in at least one of them (positions along dims)."""
    return tuple(y if x == 1 else x for x, y in zip(a, b))


def window_view(ctx: GraphBuilder, x: Value, dims, offsets, stride, padding, out_shape, ceil_mode: bool) -> Value:
    """x's elements at window offset `offsets` (along `dims`) of every output position of a pooling or
    convolution window, as a view: padded by
    `padding` (replicate_pad: the caller masks the padding), then sliced from the offset with the
    stride. With ceil_mode the last window may reach past x and its padding: the padded view then
    ends at the last position read, which a kernel reads where it lies in x only (codegen/render.py:
    unclamped), never past its end (read unguarded, C++ read 6 elements past a [1, 2, 8, 7] input)."""
    padded_shape = list(x.shape)
    widths = {}
    for d, k, s, p in zip(dims, offsets, stride, padding):
        after = as_expr(k) + (out_shape[d] - 1) * s + 1 - x.shape[d] - p if ceil_mode else as_expr(p)
        widths[d] = (as_expr(p), after)
        padded_shape[d] = x.shape[d] + p + after
    view, _ = padded_view(ctx, x, widths, tuple(padded_shape), masked=False)
    for d, k, s in zip(dims, offsets, stride):
        end = as_expr(k) + (out_shape[d] - 1) * s + 1
        view = ctx.view("slice", view, dim=d, start=as_expr(k), end=end, step=as_expr(s))
    return view


def spatial_pair(values) -> list:
    """A 2-d window's size, stride, padding or dilation for (height, width): one value (an int, or a list of
    one) stands for both, as ATen reads it (`padding="valid"` reaches the graph as [0])."""
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    return values * 2 if len(values) == 1 else values
