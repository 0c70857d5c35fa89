"""Max pooling, forward and backward, as views of its input and gradient (no ATen scatter).

The forward reads each window offset as a strided view of x and compares in eager's order; the
backward gathers, for each input position, the gradients of the outputs whose window holds it.
Both fuse like pointwise values (docs/decisions.md, "cat, constant padding and max pooling are views").
"""

from __future__ import annotations

import torch

from ember.aten.builder import GraphBuilder, ShapeDtype
from ember.aten.lowerings.positions import broadcast_shapes, logical_and, position_along, spatial_pair, window_view
from ember.aten.registry import Unsupported, lowering
from ember.ir import dtypes
from ember.ir.graph import Value
from ember.ir.sizes import as_expr

aten = torch.ops.aten


# -- max pooling: the window's elements as strided views, compared in eager's order -----------
# Each of the kh*kw window offsets is a view of x (replicate_pad on H and W, then a strided
# slice); elements in the padding read -inf. The values are a chain of NaN-propagating
# maximums; the indices follow eager's rule exactly (start at the first in-range element,
# move to a later element when it is greater or NaN), and are computed only where something
# reads them (training's backward), so inference writes no int64 index tensor. A cheap producer
# of x (ResNet's batch norm + ReLU) is recomputed per window element from cache, not stored.
MAX_POOL_WINDOW = 49


@lowering(aten.max_pool2d_with_indices)
def _max_pool2d_with_indices(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    args = list(node.args) + [None] * (6 - len(node.args))
    kernel = _pair(args[1])
    stride = _pair(args[2]) if args[2] else kernel
    padding = _pair(args[3] if args[3] is not None else 0)
    dilation = _pair(args[4] if args[4] is not None else 1)
    ceil_mode = bool(args[5])
    values_meta, indices_meta = _meta_outputs(node)
    ctx.check_kernel_tensor(values_meta)
    ctx.check_kernel_tensor(indices_meta)
    if not isinstance(x, Value) or not x.dtype.is_floating_point or dilation != (1, 1):
        raise Unsupported("max_pool2d operands (float input, dilation 1)")
    if kernel[0] * kernel[1] > MAX_POOL_WINDOW or any(s == 0 for s in values_meta.shape):
        raise Unsupported("max_pool2d window or shape")
    rank = len(x.shape)
    h_dim, w_dim = rank - 2, rank - 1
    out_shape = tuple(as_expr(s) for s in values_meta.shape)
    size_w = x.shape[w_dim]
    pos_h = position_along(ctx, ShapeDtype(out_shape, torch.int64), h_dim)
    pos_w = position_along(ctx, ShapeDtype(out_shape, torch.int64), w_dim)
    int_h, int_w = ShapeDtype(pos_h.shape, torch.int64), ShapeDtype(pos_w.shape, torch.int64)
    start_h = ctx.pointwise("add", [ctx.pointwise("mul", [pos_h, stride[0]], int_h), -padding[0]], int_h)
    start_w = ctx.pointwise("add", [ctx.pointwise("mul", [pos_w, stride[1]], int_w), -padding[1]], int_w)
    spatial = ShapeDtype(broadcast_shapes(pos_h.shape, pos_w.shape), torch.int64)
    full = ShapeDtype(out_shape, x.dtype)
    full_index = ShapeDtype(out_shape, torch.int64)

    def flat(h: Value, w: Value) -> Value:
        return ctx.pointwise("add", [ctx.pointwise("mul", [h, size_w], spatial), w], spatial)

    # eager's initial index: the window's first element inside the input
    first = flat(ctx.pointwise("maximum", [start_h, 0], int_h), ctx.pointwise("maximum", [start_w, 0], int_w))
    best, index = None, ctx.pointwise("add", [first, 0], full_index)
    for kh in range(kernel[0]):
        for kw in range(kernel[1]):
            h = ctx.pointwise("add", [start_h, kh], int_h)
            w = ctx.pointwise("add", [start_w, kw], int_w)
            window = window_view(ctx, x, (h_dim, w_dim), (kh, kw), stride, padding, out_shape, ceil_mode)
            inside = None
            for at, p, d, k, st in (
                (h, padding[0], h_dim, kernel[0], stride[0]),
                (w, padding[1], w_dim, kernel[1], stride[1]),
            ):
                # Windows reach outside x with padding, or with ceil_mode's partial last window.
                beyond = as_expr((out_shape[d] - 1) * st + k - p) - x.shape[d]
                if p or (ceil_mode and not (beyond.is_number and beyond <= 0)):  # symbolic: checked
                    within = ShapeDtype(at.shape, torch.bool)
                    for check in (
                        ctx.pointwise("ge", [at, 0], within),
                        ctx.pointwise("lt", [at, x.shape[d]], within),
                    ):
                        inside = check if inside is None else logical_and(ctx, inside, check)
            value = ctx.pointwise("where", [inside, window, float("-inf")], full) if inside is not None else window
            # eager moves to a later element when it is greater or NaN (nothing beats the first
            # element's -inf start but larger values and NaN)
            bools = ShapeDtype(out_shape, torch.bool)
            previous = best if best is not None else float("-inf")
            greater = ctx.pointwise("gt", [value, previous], bools)
            take = ctx.pointwise("logical_or", [greater, ctx.pointwise("isnan", [value], bools)], bools)
            best = value if best is None else ctx.pointwise("maximum", [value, best], full)
            index = ctx.pointwise("where", [take, flat(h, w), index], full_index)
    return best, index


@lowering(aten.max_pool2d_with_indices_backward)
def _max_pool2d_with_indices_backward(ctx: GraphBuilder, node):
    """The input's gradient as a gather, not eager's scatter: each input position (h, w) sums the
    gradients of the outputs whose window holds it and whose index names it. Along h those outputs
    are oh = (h + p) // s - j for j < ceil(k / s): grad_output repeated s times along h
    (unsqueeze, expand, reshape) and shifted by j * s - p (replicate_pad) reads oh's gradient at h,
    and 0 <= h + p - j * s < OH * s says oh exists; the same along w. Summed in eager's order
    (ascending oh, then ow) in float. So it fuses with the gradient it feeds (ResNet-50's residual
    add), and its int64 indices are read where they lie rather than by an ATen scatter."""
    args = list(node.args) + [None] * (8 - len(node.args))
    grad, x, indices = ctx.arg(args[0]), ctx.arg(args[1]), ctx.arg(args[7])
    kernel = _pair(args[2])
    stride = _pair(args[3]) if args[3] else kernel
    padding = _pair(args[4] if args[4] is not None else 0)
    dilation = _pair(args[5] if args[5] is not None else 1)
    out = ctx.out_meta()
    ctx.check_kernel_tensor(out)
    if not all(isinstance(v, Value) for v in (grad, x, indices)) or not grad.dtype.is_floating_point:
        raise Unsupported("max_pool2d backward operands")
    if dilation != (1, 1) or indices.dtype != torch.int64:
        raise Unsupported("max_pool2d backward with dilation")
    rank = len(grad.shape)
    dims = (rank - 2, rank - 1)
    out_sizes, in_sizes = [grad.shape[d] for d in dims], [x.shape[d] for d in dims]
    if not all(as_expr(v).is_Integer for v in out_sizes + in_sizes):
        raise Unsupported("max_pool2d backward with symbolic sizes")
    candidates = [-(-k // st) for k, st in zip(kernel, stride)]
    if candidates[0] * candidates[1] > MAX_POOL_WINDOW:
        raise Unsupported("max_pool2d backward window")
    in_shape = tuple(as_expr(v) for v in out.shape)
    acc = dtypes.compute_dtype(grad.dtype)

    def repeated(v: Value) -> Value:
        """v with each output position repeated `stride` times along h and w."""
        for d, st in zip(dims, stride):
            shape = v.shape[: d + 1] + (as_expr(st),) + v.shape[d + 1 :]
            v = ctx.view("expand", ctx.view("unsqueeze", v, dim=d + 1), shape=shape)
            v = ctx.reshape(v, shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2 :])
        return v

    def at_candidate(v: Value, js) -> Value:
        for d, j, st, p in zip(dims, js, stride, padding):
            v = ctx.view("replicate_pad", v, dim=d, before=as_expr(j * st - p), length=in_shape[d])
        return v

    grad_up, index_up = repeated(grad), repeated(indices)
    pos = [position_along(ctx, ShapeDtype(in_shape, torch.int64), d) for d in dims]
    here = ctx.pointwise(
        "add",
        [ctx.pointwise("mul", [pos[0], in_sizes[1]], ShapeDtype(pos[0].shape, torch.int64)), pos[1]],
        ShapeDtype(broadcast_shapes(pos[0].shape, pos[1].shape), torch.int64),
    )

    def exists(d: int, j: int) -> Value:
        """0 <= position + p - j * s < outputs * s along dims[d]: output (position + p) // s - j."""
        shifted = ctx.pointwise("add", [pos[d], padding[d] - j * stride[d]], ShapeDtype(pos[d].shape, torch.int64))
        bools = ShapeDtype(pos[d].shape, torch.bool)
        return logical_and(
            ctx,
            ctx.pointwise("ge", [shifted, 0], bools),
            ctx.pointwise("lt", [shifted, as_expr(out_sizes[d] * stride[d])], bools),
        )

    total = None
    full = ShapeDtype(in_shape, acc)
    for jh in reversed(range(candidates[0])):  # ascending output rows, as eager sums them
        for jw in reversed(range(candidates[1])):
            picked = ctx.pointwise("eq", [at_candidate(index_up, (jh, jw)), here], ShapeDtype(in_shape, torch.bool))
            take = logical_and(ctx, logical_and(ctx, exists(0, jh), exists(1, jw)), picked)
            g = at_candidate(grad_up, (jh, jw))
            g = ctx.cast(g, acc) if g.dtype != acc else g
            term = ctx.pointwise("where", [take, g, 0.0], full)
            total = term if total is None else ctx.pointwise("add", [total, term], full)
    return ctx.cast(total, out.dtype)


def _pair(v) -> tuple[int, int]:
    v = spatial_pair(v)
    if len(v) != 2 or not all(isinstance(a, int) for a in v):
        raise Unsupported("max_pool2d sizes")
    return v[0], v[1]


def _meta_outputs(node) -> tuple:
    val = node.meta.get("val")
    if not isinstance(val, (list, tuple)) or len(val) != 2:
        raise Unsupported("max_pool2d outputs")
    return val
