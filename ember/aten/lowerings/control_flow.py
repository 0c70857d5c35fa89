"""`torch.cond` and `torch.while_loop`: each branch, loop condition and loop body is compiled as its
own ember graph, and the host program runs them.

The op becomes one extern step whose target holds the compiled subgraphs (compiled through the
builder's `compile_subgraph`, which the pipeline passes in: each is a whole graph of its own, with
its own kernels, memory plan and host program, and its own eager fallback). At run time the
predicate is read on the host, as eager reads it: a device tensor costs one device-to-host read per
`cond` and per loop iteration; a predicate over sizes is a Python condition. AOTAutograd's
training graphs hold the same ops (the backward's `cond` runs the branches' gradient graphs), so
training through `cond` needs nothing more. Under CUDA graphs such a step is a reason not to
capture (runtime/cudagraphs.py: the host chooses which kernels run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ember.aten.builder import GraphBuilder
from ember.aten.registry import Unsupported, lowering

higher_order = torch.ops.higher_order


def _subgraph(ctx: GraphBuilder, gm, what: str) -> Callable:
    if ctx.compile_subgraph is None:
        raise Unsupported(f"no compiler for the {what}")  # then the op runs as a call, branches eagerly
    if not isinstance(gm, torch.fx.GraphModule):
        raise Unsupported(f"{what} is {type(gm).__name__}, not a graph")
    return ctx.compile_subgraph(gm, what)


class CondCall:
    """An extern target: read the predicate, run the branch it picks, return its results."""

    def __init__(self, true_fn: Callable, false_fn: Callable):
        self.true_fn, self.false_fn = true_fn, false_fn
        self.__name__ = "cond"

    def __call__(self, pred, operands: Sequence) -> tuple:
        branch = self.true_fn if bool(pred) else self.false_fn  # a device tensor: one read
        return tuple(branch(list(operands)))


class WhileLoopCall:
    """An extern target: run the body while the condition graph says so, one predicate read per turn."""

    def __init__(self, cond_fn: Callable, body_fn: Callable):
        self.cond_fn, self.body_fn = cond_fn, body_fn
        self.__name__ = "while_loop"

    def __call__(self, carried: Sequence, additional: Sequence) -> tuple:
        values, extra = list(carried), list(additional)
        turns = 0
        while bool(self.cond_fn([*values, *extra])[0]):
            values = list(self.body_fn([*values, *extra]))
            turns += 1
        if turns == 0:
            # The results are fresh tensors, never the caller's: the host program may hand them out.
            values = [v.clone() if isinstance(v, torch.Tensor) else v for v in values]
        return tuple(values)


@lowering(higher_order.cond)
def _cond(ctx: GraphBuilder, node):
    if len(node.args) != 4 or node.kwargs:
        raise Unsupported("cond with other arguments than (pred, true_fn, false_fn, operands)")
    pred, true_gm, false_gm, operands = node.args
    true_fn = _subgraph(ctx, ctx.arg(true_gm), "cond branch")
    false_fn = _subgraph(ctx, ctx.arg(false_gm), "cond branch")
    call = CondCall(true_fn, false_fn)
    return ctx.extern_call(call, (ctx.arg(pred), tuple(ctx.arg(operands))), {}, node.meta.get("val"), origin="cond")


@lowering(higher_order.while_loop)
def _while_loop(ctx: GraphBuilder, node):
    if len(node.args) != 4 or node.kwargs:
        raise Unsupported("while_loop with other arguments than (cond_fn, body_fn, carried, additional)")
    cond_gm, body_gm, carried, additional = node.args
    call = WhileLoopCall(
        _subgraph(ctx, ctx.arg(cond_gm), "while_loop condition"), _subgraph(ctx, ctx.arg(body_gm), "while_loop body")
    )
    args = (tuple(ctx.arg(carried)), tuple(ctx.arg(additional)))
    return ctx.extern_call(call, args, {}, node.meta.get("val"), origin="while_loop")
