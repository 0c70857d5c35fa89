"""A GPU convolution's bias added by ember's next kernel, not by cuDNN (setting `conv_bias_epilogue`).

ATen's CUDA convolution adds its bias in a launch of its own after cuDNN's kernel, for many
convolutions (the depthwise 7x7 of ConvNeXt among them): one more pass over the result in memory,
and one more launch from the host. Given the convolution without its bias,

    convolution(x, w, b, ...)   becomes   convolution(x, w, None, ...) + b.view(C, 1, ..., 1)

and the add is an ordinary pointwise op that fuses into whatever reads the result next (ConvNeXt's
layer norm, a residual add, an activation), or becomes that kernel's own epilogue. In an `ember
profile` of HF ConvNeXt-tiny's inference on the H100, 22 of those bias launches took 482 µs of a
10.2 ms step. Inductor peels the bias off the same way.

In a backward graph the bias's gradient is ember's too (`sum_bias_gradients`): convolution_backward
is asked for the input's and weight's gradients only, and the bias's becomes a sum of the output
gradient over every dim but the channels, an ember reduction that may fuse with the kernel writing
that gradient. ATen computes it in a reduction of its own over the half-precision gradient: in a
profile of HF ConvNeXt-tiny's training step on the H100, 21 such launches took 0.92 ms.

Where ATen fused the bias into the convolution's own kernel (its depthwise and
fallback kernels do), the result is now rounded to its dtype once more, before the add, as under
Inductor; where ATen added it in a launch of its own, the rounding is the same.

When: 2-d and 3-d convolutions (transposed too) on a CUDA device, with a bias; in the backward, 1-d
ones too (Whisper's front end), wherever the bias needs a gradient.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

aten = torch.ops.aten


def peel_bias(gm: fx.GraphModule) -> int:
    """Rewrite `gm` (in place) so that its CUDA convolutions with a bias add it as a separate op;
    returns how many did."""
    return _rewrite_each(gm, _peelable, _peel)


def _rewrite_each(gm: fx.GraphModule, applies, rewrite) -> int:
    """`rewrite(gm, node, fake_mode)` (True where it changed the graph) for each node `applies` to,
    checked against the graph's fake values; returns how many changed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in placeholders])
    if fake_mode is None:
        return 0  # no fake values to check a rewrite against
    done = 0
    try:
        for node in list(gm.graph.nodes):
            if applies(node) and rewrite(gm, node, fake_mode):
                done += 1
    finally:
        if done:  # each rewrite is whole: the graph is valid even when a later one raised
            gm.graph.lint()
            gm.recompile()
    return done


def _peel(gm: fx.GraphModule, node: fx.Node, fake_mode) -> bool:
    """Rewrite one convolution; False (nothing changed) where the add would not reproduce its result's
    shape, dtype and strides (an `aten.convolution` called with a bias of another dtype)."""
    bias, out = node.args[2], node.meta["val"]
    args = (*node.args[:2], None, *node.args[3:])
    shape = [-1] + [1] * (out.dim() - 2)
    with fake_mode:  # every value first: a failure leaves this convolution as it was
        conv_val = aten.convolution.default(*fx.node.map_arg(args, lambda n: n.meta["val"]))
        shaped_val = aten.view.default(bias.meta["val"], shape)
        add_val = aten.add.Tensor(conv_val, shaped_val)
    if (add_val.shape, add_val.dtype, add_val.stride()) != (out.shape, out.dtype, out.stride()):
        return False
    with gm.graph.inserting_before(node):
        conv = gm.graph.call_function(aten.convolution.default, args)
        shaped = gm.graph.call_function(aten.view.default, (bias, shape))
        add = gm.graph.call_function(aten.add.Tensor, (conv, shaped))
    for new, val in ((conv, conv_val), (shaped, shaped_val), (add, add_val)):
        new.meta["val"] = val
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in node.meta:
                new.meta[key] = node.meta[key]
    node.replace_all_uses_with(add)
    gm.graph.erase_node(node)
    return True


def _peelable(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.convolution.default or node.kwargs:
        return False
    bias = node.args[2]
    out = node.meta.get("val")
    return (
        isinstance(bias, fx.Node)
        and isinstance(out, torch.Tensor)
        and out.device.type == "cuda"
        and out.dim() in (4, 5)
        and isinstance(bias.meta.get("val"), torch.Tensor)
        and bias.meta["val"].dim() == 1
    )


def sum_bias_gradients(gm: fx.GraphModule) -> int:
    """Rewrite `gm` (a backward graph, in place) so that its CUDA convolution_backward calls leave the
    bias's gradient to a sum over the output gradient; returns how many did."""
    return _rewrite_each(gm, _bias_gradient_computed, _sum_bias_gradient)


def _bias_gradient_computed(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.convolution_backward.default or node.kwargs:
        return False
    grad, mask, vals = node.args[0], node.args[-1], node.meta.get("val")
    return (
        len(node.args) == 11
        and isinstance(mask, (list, tuple))
        and len(mask) == 3
        and mask[2] is True
        and isinstance(grad, fx.Node)
        and isinstance(grad.meta.get("val"), torch.Tensor)
        and grad.meta["val"].device.type == "cuda"
        and grad.meta["val"].dim() in (3, 4, 5)
        and isinstance(vals, (list, tuple))
        and isinstance(vals[2], torch.Tensor)
    )


def _sum_bias_gradient(gm: fx.GraphModule, node: fx.Node, fake_mode) -> bool:
    """Rewrite one convolution_backward; False (nothing changed) where the sum would not give the
    bias gradient's shape and dtype, or its result is read other than by indexing."""
    if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
        return False
    grad, want = node.args[0], node.meta["val"][2]
    dims = [0, *range(2, grad.meta["val"].dim())]
    mask = list(node.args[-1])
    args = (*node.args[:-1], [mask[0], mask[1], False])
    with fake_mode:
        vals = aten.convolution_backward.default(*fx.node.map_arg(args, lambda n: n.meta["val"]))
        sum_val = aten.sum.dim_IntList(grad.meta["val"], dims)
    if (sum_val.shape, sum_val.dtype) != (want.shape, want.dtype):
        return False
    with gm.graph.inserting_after(node):
        total = gm.graph.call_function(aten.sum.dim_IntList, (grad, dims))
    total.meta["val"] = sum_val
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in node.meta:
            total.meta[key] = node.meta[key]
    node.args = args
    node.meta["val"] = vals
    for user in list(node.users):
        if user.args[1] == 2:
            user.replace_all_uses_with(total)
            gm.graph.erase_node(user)
    return True
