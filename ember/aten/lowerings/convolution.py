"""Depthwise convolutions as sums over their window's views (target heuristic `lower.depthwise_convolutions`).

A depthwise convolution (one filter per channel: groups == in channels == out channels) is, per output
position, a short sum over the window:

    out[n, c, oh, ow] = bias[c] + sum over (kh, kw) of x_padded[n, c, oh * s + kh * d, ow * s + kw * d] * w[c, 0, kh, kw]

Each window offset is a strided view of x (positions.window_view, as max pooling reads its windows), masked
to zero in the padding, times one weight per channel. The result is a pointwise value: it fuses with the
padding before it, and with the batch norm and activation after it, into one kernel, where a library call
reads a padded copy and writes a result that another kernel then scales and clamps. The other convolutions
(and any depthwise one over more than MAX_TAPS window positions) stay library calls, as does the backward.
"""

from __future__ import annotations

import torch

from ember.aten.builder import GraphBuilder, ShapeDtype
from ember.aten.lowerings.positions import logical_and, position_along, spatial_pair, window_view
from ember.aten.registry import Unsupported, lowering
from ember.ir import dtypes
from ember.ir.graph import Value
from ember.ir.sizes import as_expr

aten = torch.ops.aten

# The window positions summed in a kernel (7 x 7): each one is a load and a multiply-add per output.
MAX_TAPS = 49


def is_depthwise(x_shape, w_shape, transposed: bool, groups: int) -> bool:
    """Whether a 2-d convolution of these sizes is depthwise, of static sizes and at most MAX_TAPS taps
    (also asked by the CPU's prepacking, frontend/prepack.py, which leaves such convolutions to ember)."""
    if transposed or len(x_shape) != 4 or len(w_shape) != 4:
        return False
    if not all(isinstance(s, int) for s in tuple(w_shape) + (x_shape[1],)):
        return False
    channels = x_shape[1]
    return groups == channels == w_shape[0] and w_shape[1] == 1 and w_shape[2] * w_shape[3] <= MAX_TAPS


@lowering(aten.convolution)
def _convolution(ctx: GraphBuilder, node):
    stride, padding, dilation, transposed, _, groups = node.args[3:9]
    if not ctx.lower.depthwise_convolutions:
        raise Unsupported("convolution (the target's library computes it)")
    x, w, bias = (ctx.arg(a) for a in node.args[:3])
    if not isinstance(x, Value) or not isinstance(w, Value) or not (bias is None or isinstance(bias, Value)):
        raise Unsupported("convolution operands")
    if not is_depthwise(_static(x.shape), _static(w.shape), bool(transposed), groups):
        raise Unsupported("convolution (not depthwise, or a window over MAX_TAPS)")
    if not x.dtype.is_floating_point or w.dtype != x.dtype:
        raise Unsupported("convolution dtypes")
    weight = node.args[1].meta.get("val")
    if not isinstance(weight, torch.Tensor) or weight.stride(0) != 1:
        # A row-major weight would be read KH * KW elements apart along the kernel's vector loop over
        # channels; freezing lays frozen weights out with channels innermost (frontend/prepack.py).
        raise Unsupported("depthwise convolution over a weight without its channels innermost")
    stride, padding, dilation = (spatial_pair(p) for p in (stride, padding, dilation))
    if len(stride) != 2 or len(padding) != 2 or len(dilation) != 2:
        raise Unsupported("convolution sizes")
    out = ctx.out_meta()
    ctx.check_kernel_tensor(out)
    out_shape = tuple(as_expr(s) for s in out.shape)
    acc = dtypes.compute_dtype(x.dtype)
    full = ShapeDtype(out_shape, acc)
    dims = (2, 3)
    channels = x.shape[1]
    taps = ctx.reshape(w, (channels, int(w.shape[2]) * int(w.shape[3])))
    starts = [position_along(ctx, ShapeDtype(out_shape, torch.int64), d) for d in dims]
    total = None
    for kh in range(int(w.shape[2])):
        for kw in range(int(w.shape[3])):
            offsets = (kh * dilation[0], kw * dilation[1])
            window = window_view(ctx, x, dims, offsets, stride, padding, out_shape, False)
            window = ctx.cast(window, acc)
            inside = None
            for d, at, st, p, off in zip(dims, starts, stride, padding, offsets):
                if not p:
                    continue  # no padding: every position reads x
                pos = ShapeDtype(at.shape, torch.int64)
                h = ctx.pointwise("add", [ctx.pointwise("mul", [at, st], pos), off - p], pos)
                bools = ShapeDtype(at.shape, torch.bool)
                for check in (ctx.pointwise("ge", [h, 0], bools), ctx.pointwise("lt", [h, x.shape[d]], bools)):
                    inside = check if inside is None else logical_and(ctx, inside, check)
            if inside is not None:
                window = ctx.pointwise("where", [inside, window, 0.0], full)
            tap = ctx.view("select", taps, dim=1, index=as_expr(kh * int(w.shape[3]) + kw))
            tap = ctx.reshape(tap, (channels, 1, 1))
            tap = ctx.cast(tap, acc)
            term = ctx.pointwise("mul", [window, tap], full)
            total = term if total is None else ctx.pointwise("add", [total, term], full)
    if bias is not None:
        b = ctx.reshape(bias, (channels, 1, 1))
        total = ctx.pointwise("add", [total, ctx.cast(b, acc)], full)
    return ctx.cast(total, out.dtype)


def _static(shape) -> list:
    """Sizes as ints where they are numbers (symbolic ones stay expressions)."""
    return [int(s) if as_expr(s).is_Integer else s for s in shape]
