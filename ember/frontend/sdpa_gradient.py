"""The `sdpa_gradient` pass: each CUDA SDPA call's backward receives its output gradient laid out as
its output.

SDPA is one op in Dynamo's graph; AOTAutograd's trace resolves it to one of ATen's kernels, and on
Hopper torch 2.11 picks cuDNN's (`_scaled_dot_product_cudnn_attention` and its backward) for most
calls. torch 2.11 caches cuDNN's backward plans by the query's, key's and value's sizes and strides,
not by the strides of the output or of its gradient, and a plan run over a gradient laid out
otherwise than at the call that built it computes wrong gradients, silently. ember's backward
graphs hand the kernel whatever layout their kernels gave the gradient: on an H100, in one process
that also ran each case eagerly, 13 of 76 compiled cases (heads as transposed views of [batch,
tokens, heads, size], as transformers' models make them, or of one q/k/v projection) had query,
key and value gradients 46-525 times eager's error (docs/bench/h100.md). eager is exposed the same
way; a model's own transpose back mostly gives its gradient the output's layout, call after call.

So, before AOTAutograd, every SDPA call of a graph on a CUDA device (its activation-checkpointed
regions' included) is pointed at
`sdpa_output_layout_gradient`: SDPA itself, then the identity whose backward lays the incoming
gradient out as SDPA's output (which torch allocates in the query's layout). Each plan then meets
one gradient layout per query layout, as in eager. Where the gradient already comes so (the usual
case), AOTAutograd traces nothing; otherwise one copy, before the attention backward. Inference
graphs trace nothing at all. The kernels torch picks are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from ember import config, log


def sdpa_output_layout_gradient(*args, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, whose backward gets its output gradient in the output's layout."""
    out = F.scaled_dot_product_attention(*args, **kwargs)
    return _GradientAsOutput.apply(out) if out.requires_grad else out


class _GradientAsOutput(torch.autograd.Function):
    """The identity, whose backward lays the incoming gradient out as the forward's result was."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.layout = x.stride()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == ctx.layout:
            return grad
        return torch.empty_strided(grad.shape, ctx.layout, dtype=grad.dtype, device=grad.device).copy_(grad)


def sdpa_gradient_pass(gm: fx.GraphModule, example_inputs) -> int:
    """The pass as the backend runs it: the SDPA calls of a CUDA graph rewritten; how many. An
    unexpected failure leaves the graph as Dynamo gave it, with a warning (EMBER_STRICT=1 raises)."""
    try:
        if not any(_is_sdpa(n) for m in _graphs(gm) for n in m.graph.nodes) or not _on_cuda(gm, example_inputs):
            return 0
        return rewrite_sdpa_calls(gm)
    except Exception as e:
        if config.get("strict"):
            raise
        log.warn(f"ember: SDPA gradient layouts left as traced: {type(e).__name__}: {e}")
        return 0


def rewrite_sdpa_calls(gm: fx.GraphModule) -> int:
    """Point every SDPA call of `gm` and of the graphs it calls (an activation-checkpointed region's
    body) at `sdpa_output_layout_gradient`; returns how many."""
    changed = []
    for module in _graphs(gm):
        found = [n for n in module.graph.nodes if _is_sdpa(n)]
        for node in found:
            node.target = sdpa_output_layout_gradient
        if found:
            module.recompile()
        changed += found
    if changed:
        log.artifact(
            "patterns",
            f"{len(changed)} SDPA call(s): gradient laid out as the output",
            ", ".join(n.name for n in changed),
        )
    return len(changed)


def _graphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """`gm` and the bodies of its activation-checkpointed regions (their SDPA calls are traced with
    the region, forward and recomputed backward alike); a cond branch or loop body is left alone."""
    checkpoint = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    bodies = [
        getattr(gm, n.args[0].target, None)
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target is checkpoint
        and n.args
        and getattr(n.args[0], "op", None) == "get_attr"
    ]
    return [gm] + [b for b in bodies if isinstance(b, fx.GraphModule)]


def _on_cuda(gm: fx.GraphModule, example_inputs) -> bool:
    from ember.pipeline import graph_device

    return graph_device(gm, example_inputs).type == "cuda"


def _is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.scaled_dot_product_attention
