"""Prepacked convolutions on the CPU under freezing (setting `prepack`).

oneDNN, which runs ATen's CPU convolutions, reads a weight in a blocked layout chosen for the
convolution's shapes (output channels in blocks of the vector width). ATen's convolution is handed a
plain weight and reorders it on every call: on the 2-core CPU machine at batch 1, a 3x3 convolution
over 512 channels at 7x7 took 2.3 ms through `aten.convolution` and 1.06 ms on a weight packed once
(1.1x at 256 channels, even at 64). Under freezing the weight is a constant, so

    conv(x, w, b)            becomes   mkldnn._convolution_pointwise(x, packed, b, ..., attr)
                                       packed = mkldnn._reorder_convolution_weight(w, ..., x's sizes)

and the reorder, reading frozen tensors only, moves into the freezing prologue with the rest
(frontend/freezing.py): it runs once. The convolution's activation, where the convolution's result
has no other reader, becomes oneDNN's post-op (`attr`), applied as each output block is written:

    relu(y)                              "relu"
    clamp(y, lo, hi), hardtanh(y, lo, hi) "hardtanh" [lo, hi]   (MobileNet's ReLU6)
    y * sigmoid(y)                       "swish"                 (EfficientNet's SiLU)
    sigmoid(y)                           "sigmoid"

Matrix products whose right operand is frozen (a linear layer's transposed weight) are packed the same
way: `addmm(bias, x, w)` becomes `mkldnn._linear_pointwise(x, packed, bias)` over
`mkldnn._reorder_linear_weight(w.t(), x's rows)`, where oneDNN's kernel on the packed weight measured
faster than ATen's `mm`/`addmm` (MKL's sgemm) on this CPU at the product's shape (the Target's
`packed_product_faster`: measured once per machine and shape, backends/cpu_products.py): which one wins
depends on the CPU and the shape.

Batch norm before the activation is folded into the packed weight (freezing.fold_affine, told so by
`packable`), so that conv, batch norm and activation are one oneDNN call.

Fake tensors have no mkldnn layout: the packed weight's value in the graph is a stand-in, a dense
tensor of the weight's sizes; only the convolution or product reads it. Memory: the packed weights are a
second copy of the weights beside the model's own (as under Inductor's freezing, and as ONNX
Runtime holds its own); `prepack=False` keeps them unpacked.

A zero pad of equal widths before the convolution (TensorFlow-style models pad explicitly) becomes
the convolution's own padding, without a copy (`_absorb_zero_pad`).

When: float32 2-d convolutions (not transposed) and 2-d matrix products of static sizes on the CPU, with
frozen weights and biases, where this torch has oneDNN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from ember.aten.lowerings.convolution import is_depthwise
from ember.aten.lowerings.positions import spatial_pair
from ember.target import LowerHeuristics, Target

aten = torch.ops.aten


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_convolution_weight")


def _static_cpu_float32(operands, dim: int) -> bool:
    """Whether every operand is an FX node whose value is a float32 CPU tensor of `dim` static sizes."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in operands]
    return all(
        isinstance(t, torch.Tensor)
        and t.dim() == dim
        and t.device.type == "cpu"
        and t.dtype == torch.float32
        and all(isinstance(s, int) for s in t.shape)
        for t in vals
    )


def packable(node: fx.Node, is_constant: Callable[[object], bool], lower: LowerHeuristics | None = None) -> bool:
    """A float32 2-d convolution (not transposed) of static sizes on the CPU whose weight and bias are
    computed from frozen tensors (`is_constant`), but for a depthwise one where the target computes those
    itself (`lower.depthwise_convolutions`: aten/lowerings/convolution.py)."""
    if node.op != "call_function" or node.target is not aten.convolution.default or node.args[6]:
        return False
    if not _static_cpu_float32(node.args[:2], dim=4):
        return False
    x, w = (a.meta["val"] for a in node.args[:2])
    if (
        lower is not None
        and lower.depthwise_convolutions
        and is_depthwise(tuple(x.shape), tuple(w.shape), False, node.args[8])
    ):
        return False
    if any(p != 0 for p in node.args[7]):  # output padding (transposed convolutions only)
        return False
    return is_constant(node.args[1]) and (node.args[2] is None or is_constant(node.args[2]))


def packable_linear(node: fx.Node, is_constant: Callable[[object], bool]) -> bool:
    """A float32 `mm(x, w)` or `addmm(bias, x, w)` of static sizes on the CPU whose weight (and bias, of the
    output's width) are computed from frozen tensors."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default) or node.kwargs:
        return False
    bias, x, w = node.args if node.target is aten.addmm.default else (None, *node.args)
    if not _static_cpu_float32((x, w), dim=2):
        return False
    if bias is not None:
        b = bias.meta.get("val") if isinstance(bias, fx.Node) else None
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (w.meta["val"].shape[1],) or b.dtype != torch.float32:
            return False
        if not is_constant(bias):
            return False
    return is_constant(w)


def relayout_depthwise_weights(gm: fx.GraphModule, is_constant: Callable[[object], bool], fake_mode) -> int:
    """Give each depthwise convolution over a frozen weight ([C, 1, KH, KW]) that weight with its channels
    innermost in memory, `w.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)`, which the freezing
    prologue computes once: ember's kernel (aten/lowerings/convolution.py, which takes only such weights)
    reads each window position's weights along its vector loop over channels, where a row-major weight
    would be read 9 elements apart. Returns how many weights were laid out so."""
    count = 0
    graph = gm.graph
    for conv in [n for n in graph.nodes if _depthwise_over_constant(n, is_constant)]:
        w = conv.args[1]
        with graph.inserting_before(conv):
            inner = graph.call_function(aten.permute.default, (w, [2, 3, 1, 0]))
            copy = graph.call_function(aten.clone.default, (inner,), {"memory_format": torch.contiguous_format})
            outer = graph.call_function(aten.permute.default, (copy, [3, 2, 0, 1]))
            with fake_mode:
                inner.meta["val"] = w.meta["val"].permute(2, 3, 1, 0)
                copy.meta["val"] = inner.meta["val"].clone(memory_format=torch.contiguous_format)
                outer.meta["val"] = copy.meta["val"].permute(3, 2, 0, 1)
        conv.replace_input_with(w, outer)
        count += 1
    if count:
        gm.recompile()
    return count


def _depthwise_over_constant(node: fx.Node, is_constant: Callable[[object], bool]) -> bool:
    if node.op != "call_function" or node.target is not aten.convolution.default:
        return False
    if not _static_cpu_float32(node.args[:2], dim=4) or not is_constant(node.args[1]):
        return False
    x, w = (a.meta["val"] for a in node.args[:2])
    return is_depthwise(tuple(x.shape), tuple(w.shape), bool(node.args[6]), node.args[8]) and w.stride(0) != 1


# What `prepack` counts: convolutions packed, activations fused, products packed, products left to ATen
# (measured faster), 1x1 convolutions made BLAS products.
COUNTS = ("packed", "fused", "linear", "linear_aten", "products")


def prepack(
    gm: fx.GraphModule,
    is_constant: Callable[[object], bool],
    fake_mode,
    target: Target | None = None,
) -> dict[str, int]:
    """Rewrite the graph's packable convolutions and matrix products (in place) as oneDNN's over packed
    weights, convolutions with their activations fused; returns the counts COUNTS names.
    `target`: its `heuristics.lower` choices (depthwise convolutions left to its kernels; 1x1 convolutions
    over at least `product_convolutions_min_channels` channels, or over at most
    `product_convolutions_max_pixels` pixels, as `addmm` over the input's [pixels, channels] view,
    `_as_product`), and its measured `packed_product_faster` for the matrix products; None: no product
    packed, no convolution left to ember."""
    lower = target.heuristics.lower if target is not None else LowerHeuristics()
    counts = dict.fromkeys(COUNTS, 0)
    graph = gm.graph
    for mm in [n for n in graph.nodes if packable_linear(n, is_constant)]:
        if not _packing_pays(mm, target):
            counts["linear_aten"] += 1
            continue
        _pack_linear(graph, mm, fake_mode)
        counts["linear"] += 1
    for conv in [n for n in graph.nodes if packable(n, is_constant, lower)]:
        x, w, bias, stride, padding, dilation, _, _, groups = conv.args
        stride, padding, dilation = (spatial_pair(p) for p in (stride, padding, dilation))
        x, padding = _absorb_zero_pad(x, padding)
        if _as_product(graph, conv, x, stride, padding, dilation, lower, fake_mode):
            counts["products"] += 1
            continue
        xval, wval = x.meta["val"], w.meta["val"]
        attr, scalars, last = _activation(conv)
        with graph.inserting_before(conv):
            packed = graph.call_function(
                torch.ops.mkldnn._reorder_convolution_weight.default,
                (w, padding, stride, dilation, groups, list(xval.shape)),
            )
            with fake_mode:
                packed.meta["val"] = torch.empty(wval.shape, dtype=wval.dtype, device=wval.device)  # stand-in
        with graph.inserting_before(last):
            args = (x, packed, bias, padding, stride, dilation, groups, attr, scalars, None)
            new = graph.call_function(torch.ops.mkldnn._convolution_pointwise.default, args)
            with fake_mode:
                new.meta["val"] = torch.ops.mkldnn._convolution_pointwise.default(
                    *fx.node.map_arg(args, lambda n: n.meta["val"])
                )
        new.meta["stack_trace"] = conv.meta.get("stack_trace")
        last.replace_all_uses_with(new)
        counts["packed"] += 1
        counts["fused"] += attr != "none"
    if counts["packed"] or counts["linear"] or counts["products"]:
        graph.eliminate_dead_code()
        gm.recompile()
    return counts


# Activations that a convolution's readers would not recompute (too costly, realize.py): left to oneDNN's
# post-op, which applies them in the convolution's own output pass. EfficientNet-B0's SiLUs after 1x1
# convolutions made BLAS products cost a pass of their own: 21.0 against 16.5 ms a call.
_TRANSCENDENTAL_POST_OPS = ("swish", "sigmoid")


def _as_product(
    graph: fx.Graph,
    conv: fx.Node,
    x: fx.Node,
    stride: list,
    padding: list,
    dilation: list,
    lower: LowerHeuristics,
    fake_mode,
) -> bool:
    """A 1x1 convolution (stride 1, no padding, one group) over a channels-last input of at least
    `lower.product_convolutions_min_channels` channels, or of at most `lower.product_convolutions_max_pixels`
    pixels whatever its channels and activation (a squeeze-and-excite block's pooled [n, c, 1, 1]), rewritten
    as BLAS's product over the input's [pixels, channels] view:

        y = addmm(bias, x.permute(0, 2, 3, 1).view(pixels, cin), w.view(cout, cin).t()).view(n, h, w, cout)
                .permute(0, 3, 1, 2)                                   (channels-last, as the convolution's)

    Its activation is left to ember's kernels, which fuse it into the next reader. On the 2-core CPU, over
    the 19 1x1 shapes of MobileNetV2 and EfficientNet-B0 at batch 1, MKL's `addmm` took 2.1 ms against 2.8 ms
    for oneDNN's packed convolutions with their activation (oneDNN's calls cost some 35 us each beyond the
    work); below 32 input channels `addmm` was the slower (16 -> 96 at 112x112: 444 against 334 us)."""
    w, bias, groups = conv.args[1], conv.args[2], conv.args[8]
    xval, wval = x.meta["val"], w.meta["val"]
    if groups != 1 or tuple(wval.shape[2:]) != (1, 1):
        return False
    if stride != [1, 1] or padding != [0, 0] or dilation != [1, 1]:
        return False
    if not xval.is_contiguous(memory_format=torch.channels_last):
        return False
    # Over a few pixels the product is a matrix-vector one: oneDNN's call would cost more than the work,
    # and an activation's pass over that few values costs nothing.
    few_pixels = xval.shape[0] * xval.shape[2] * xval.shape[3] <= lower.product_convolutions_max_pixels
    min_channels = lower.product_convolutions_min_channels
    if not few_pixels and (not min_channels or xval.shape[1] < min_channels):
        return False
    if _activation(conv)[0] in _TRANSCENDENTAL_POST_OPS and not few_pixels:
        return False  # oneDNN applies it as it writes; ember would store it again (its readers recompute it)
    n, cin, h, width = xval.shape
    cout = wval.shape[0]
    with graph.inserting_before(conv):
        rows = graph.call_function(aten.permute.default, (x, [0, 2, 3, 1]))
        rows = graph.call_function(aten.view.default, (rows, [n * h * width, cin]))
        weight = graph.call_function(aten.view.default, (w, [cout, cin]))
        weight = graph.call_function(aten.permute.default, (weight, [1, 0]))
        args = (rows, weight) if bias is None else (bias, rows, weight)
        product = graph.call_function(aten.mm.default if bias is None else aten.addmm.default, args)
        pixels = graph.call_function(aten.view.default, (product, [n, h, width, cout]))
        y = graph.call_function(aten.permute.default, (pixels, [0, 3, 1, 2]))
    with fake_mode:
        for node in (rows.args[0], rows, weight.args[0], weight, product, pixels, y):
            node.meta["val"] = node.target(*fx.node.map_arg(node.args, lambda a: a.meta["val"]))
    y.meta["stack_trace"] = conv.meta.get("stack_trace")
    conv.replace_all_uses_with(y)
    return True


def _packing_pays(mm: fx.Node, target: Target | None) -> bool:
    """Whether oneDNN's product over the packed weight measured faster than ATen's at this product's
    shape on the target's device (Target.packed_product_faster)."""
    if target is None or target.packed_product_faster is None:
        return False
    bias, x, w = mm.args if mm.target is aten.addmm.default else (None, *mm.args)
    rows, k = x.meta["val"].shape
    return target.packed_product_faster(int(rows), int(k), int(w.meta["val"].shape[1]), bias is not None)


def _pack_linear(graph: fx.Graph, mm: fx.Node, fake_mode) -> None:
    """`x @ w (+ bias)` as `mkldnn._linear_pointwise(x, packed, bias)`, `packed` being the [N, K] weight
    (`w` transposed back: a view of the model's own) reordered for x's row count."""
    bias, x, w = mm.args if mm.target is aten.addmm.default else (None, *mm.args)
    rows = x.meta["val"].shape[0]
    with graph.inserting_before(mm):
        weight = graph.call_function(aten.permute.default, (w, [1, 0]))
        packed = graph.call_function(torch.ops.mkldnn._reorder_linear_weight.default, (weight, rows))
        new = graph.call_function(torch.ops.mkldnn._linear_pointwise.default, (x, packed, bias, "none", [], ""))
    with fake_mode:
        weight.meta["val"] = w.meta["val"].permute(1, 0)
        packed.meta["val"] = torch.empty(weight.meta["val"].shape, dtype=torch.float32)  # stand-in
        new.meta["val"] = torch.ops.mkldnn._linear_pointwise.default(
            *fx.node.map_arg(new.args, lambda n: n.meta["val"])
        )
    new.meta["stack_trace"] = mm.meta.get("stack_trace")
    mm.replace_all_uses_with(new)


def _absorb_zero_pad(x: fx.Node, padding: list) -> tuple[fx.Node, list]:
    """A convolution's input made by a zero `constant_pad_nd` of equal widths on both sides of each
    spatial dim (TensorFlow-style models pad explicitly: HF's MobileNetV2 before every convolution,
    mostly by zero widths) is read unpadded, the widths added to the convolution's own padding, which
    oneDNN applies without a copy. A pad of unequal widths (stride 2's [0, 1]) stays."""
    if x.op != "call_function" or x.target is not aten.constant_pad_nd.default:
        return x, padding
    pads = list(x.args[1])
    value = x.args[2] if len(x.args) > 2 else x.kwargs.get("value", 0)
    if value != 0 or len(pads) not in (2, 4) or any(not isinstance(p, int) or p < 0 for p in pads):
        return x, padding
    widths = [pads[2], pads[0]] if len(pads) == 4 else [0, pads[0]]  # (height, width)
    if pads[0] != pads[1] or (len(pads) == 4 and pads[2] != pads[3]):
        return x, padding
    return x.args[0], [p + w for p, w in zip(padding, widths, strict=True)]


def _activation(conv: fx.Node) -> tuple[str, list, fx.Node]:
    """oneDNN's post-op for the activation that alone reads `conv`'s result: (attr, scalars, the node
    whose value the fused convolution replaces); ("none", [], conv) where there is none."""
    readers = list(conv.users)
    if len(readers) == 1:
        (act,) = readers
        if act.target is aten.relu.default:
            return "relu", [], act
        if act.target is aten.sigmoid.default:
            return "sigmoid", [], act
        if act.target in (aten.clamp.default, aten.hardtanh.default) and not act.kwargs:
            bounds = list(act.args[1:3]) + [None] * (3 - len(act.args))
            if act.target is aten.hardtanh.default:
                bounds = [bounds[0] if bounds[0] is not None else -1.0, bounds[1] if bounds[1] is not None else 1.0]
            if all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds):
                return "hardtanh", [float(bounds[0]), float(bounds[1])], act
    if len(readers) == 2:  # y * sigmoid(y)
        sig = next((r for r in readers if r.target is aten.sigmoid.default), None)
        mul = next((r for r in readers if r.target is aten.mul.Tensor), None)
        if sig is not None and mul is not None and set(mul.args) == {conv, sig} and list(sig.users) == [mul]:
            return "swish", [], mul
    return "none", [], conv
