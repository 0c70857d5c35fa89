"""Reductions: sum, amax/amin, all/any, mean, var and var_mean, each as ember reduce values (a mean
sums in float32 and divides once; a variance is two passes over the same input, mean then squares).
"""

from __future__ import annotations

import torch

from ember.aten.builder import GraphBuilder, ShapeDtype
from ember.aten.registry import Unsupported, lowering

aten = torch.ops.aten


def _dims_keepdim(node, dim_index=1):
    dims = node.args[dim_index] if len(node.args) > dim_index else node.kwargs.get("dim")
    keepdim = node.args[dim_index + 1] if len(node.args) > dim_index + 1 else node.kwargs.get("keepdim", False)
    if isinstance(dims, int):
        dims = [dims]
    return list(dims) if dims else [], bool(keepdim)


def _converted_input(ctx: GraphBuilder, node):
    """The reduction's input, converted first where the call names a `dtype`, as eager converts it (a
    bfloat16 linear layer's bias gradient is summed with dtype=float32 in torch 2.11's backward)."""
    x = ctx.arg(node.args[0])
    dtype = node.kwargs.get("dtype")
    return x if dtype is None or dtype == x.dtype else ctx.cast(x, dtype)


@lowering(aten.sum)
def _sum(ctx: GraphBuilder, node):
    x = _converted_input(ctx, node)
    dims, keepdim = _dims_keepdim(node)
    return ctx.reduce("sum", x, dims, keepdim, ctx.out_meta().dtype)


@lowering(aten.amax, aten.amin)
def _amax(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    dims, keepdim = _dims_keepdim(node)
    kind = "max" if node.target.overloadpacket is aten.amax else "min"
    return ctx.reduce(kind, x, dims, keepdim, ctx.out_meta().dtype)


@lowering(aten.all, aten.any)
def _all_any(ctx: GraphBuilder, node):
    """all/any: the min/max of `x != 0` as bool (_safe_softmax's "is the whole row -inf")."""
    x = ctx.arg(node.args[0])
    if ctx.out_meta().dtype != torch.bool:
        raise Unsupported("all/any with a uint8 result")
    dims, keepdim = _dims_keepdim(node)
    dims = dims or list(range(len(x.shape)))
    truth = x if x.dtype == torch.bool else ctx.pointwise("ne", [x, 0], ShapeDtype(x.shape, torch.bool))
    kind = "min" if node.target.overloadpacket is aten.all else "max"
    return ctx.reduce(kind, truth, dims, keepdim, torch.bool)


def _mean(ctx: GraphBuilder, x, dims, keepdim, out_dtype):
    """sum in float32 (or float64), divided by the count, cast once at the end as eager does."""
    if not out_dtype.is_floating_point:
        raise Unsupported("integer mean")
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    total = ctx.reduce("sum", ctx.cast(x, acc) if x.dtype != acc else x, dims, keepdim, acc)
    count = ctx.numel(x, [d % len(x.shape) for d in dims]) if x.shape else 1
    mean = ctx.pointwise("truediv", [total, count], ShapeDtype(total.shape, acc))
    return mean


@lowering(aten.mean)
def _mean_lowering(ctx: GraphBuilder, node):
    x = _converted_input(ctx, node)
    dims, keepdim = _dims_keepdim(node)
    out = ctx.out_meta()
    return ctx.cast(_mean(ctx, x, dims, keepdim, out.dtype), out.dtype)


def _var_mean(ctx: GraphBuilder, node):
    x = ctx.arg(node.args[0])
    if not x.shape:
        raise Unsupported("variance of a 0-d tensor")  # dim=0/-1 names no dim to count over
    dims, _ = _dims_keepdim(node)
    dims = dims or list(range(len(x.shape)))
    correction = node.kwargs.get("correction", 1)
    correction = 1 if correction is None else correction
    keepdim = node.kwargs.get("keepdim", False)
    out_dtype = x.dtype
    mean_keep = _mean(ctx, x, dims, True, out_dtype)
    acc = mean_keep.dtype
    diff = ctx.pointwise("sub", [x, mean_keep], ShapeDtype(x.shape, acc))
    sq = ctx.pointwise("mul", [diff, diff], ShapeDtype(x.shape, acc))
    total = ctx.reduce("sum", sq, dims, keepdim, acc)
    count = ctx.numel(x, [d % len(x.shape) for d in dims])
    # Eager divides by max(0, N - correction); a float correction (std(unbiased=...) passes 1.0, OpInfo
    # passes 0.3) must stay a Python number, not enter a size expression.
    if isinstance(correction, float) and correction.is_integer():
        correction = int(correction)
    divisor = count - correction
    if divisor.is_number:
        divisor = max(0, float(divisor) if isinstance(correction, float) else int(divisor))
    elif isinstance(correction, float):
        raise Unsupported("fractional correction with a symbolic count")
    var = ctx.pointwise("truediv", [total, divisor], ShapeDtype(total.shape, acc))
    mean = mean_keep if keepdim else ctx.view("squeeze", mean_keep, dims=tuple(sorted(d % len(x.shape) for d in dims)))
    return ctx.cast(var, out_dtype), ctx.cast(mean, out_dtype)


@lowering(aten.var)
def _var(ctx: GraphBuilder, node):
    if node.target != aten.var.correction:
        raise Unsupported("var overload")
    return _var_mean(ctx, node)[0]


@lowering(aten.var_mean)
def _var_mean_lowering(ctx: GraphBuilder, node):
    if node.target != aten.var_mean.correction:
        raise Unsupported("var_mean overload")
    return _var_mean(ctx, node)
