"""Activation checkpointing's RNG ops: `run_and_save_rng_state(op, *args)` gives the default
generator's state and op's result; `run_with_rng_state(state, op, *args)` runs op with the generator
at that state and puts it back. AOTAutograd's partitioner wraps each random op (tagged
nondeterministic_seeded: dropout, SDPA, rand_like) that the backward of a checkpointed region
recomputes in them, so that the recomputation draws what the forward drew: on the CPU, and on CUDA
where its graph-safe form is off or the graph spans devices. (On one CUDA device torch 2.11 uses
that form, `graphsafe_run_with_rng_state` over generator inputs, which ember does not compile: such
a graph runs eagerly, with a warning.)

Each becomes one extern step that calls the higher-order op itself (torch's own implementation per
device: the state is a CPU byte tensor, read and set on the host), with its nested result
(state, (out, ...)) flattened for the step and rebuilt for the getitems that read it. Under CUDA
graphs such a step is a reason not to capture (runtime/cudagraphs.py): it reads the generator's
state on the host.
"""

from __future__ import annotations

import operator

import torch
from torch._guards import detect_fake_mode
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from ember.aten.builder import GraphBuilder, op_name
from ember.aten.registry import Unsupported, lowering


class SavedRngCall:
    """An extern target: `run_and_save_rng_state(op, ...)` with its result flat: (state, *outputs)."""

    def __init__(self, op, nested: bool):
        self.op, self.nested = op, nested
        self.__name__ = f"run_and_save_rng_state_{op_name(op)}"

    def __call__(self, *args, **kwargs) -> tuple:
        state, out = run_and_save_rng_state(self.op, *args, **kwargs)
        return (state, *out) if self.nested else (state, out)


class WithRngCall:
    """An extern target: `run_with_rng_state(state, op, ...)`."""

    def __init__(self, op):
        self.op = op
        self.__name__ = f"run_with_rng_state_{op_name(op)}"

    def __call__(self, state, *args, **kwargs):
        return run_with_rng_state(state, self.op, *args, **kwargs)


def _check_op(op) -> None:
    if not isinstance(op, torch._ops.OpOverload):
        raise Unsupported(f"an RNG-state op around {type(op).__name__}, not an ATen op")


def _result_meta(node, op, args, kwargs):
    """op's result as AOTAutograd recorded it: where the partitioner made the node without a value
    (it does for these ops), the op run on the arguments' fake values."""
    val = node.meta.get("val")
    if val is not None:
        return val[1] if node.target is run_and_save_rng_state else val
    fake = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta.get("val"))
    mode = detect_fake_mode(torch.utils._pytree.tree_leaves(fake))
    if mode is None:
        raise Unsupported(f"{node.name}: no recorded value")
    with mode:
        return op(*fake[0], **fake[1])


def _state_meta(node):
    val = node.meta.get("val")
    if val is not None:
        return val[0]
    if not all(u.target is operator.getitem for u in node.users):
        raise Unsupported(f"{node.name}: its result is read other than by index")
    states = [u.meta.get("val") for u in node.users if u.args[1] == 0]
    if not states or states[0] is None:
        raise Unsupported(f"{node.name}: the generator's state is not read")
    return states[0]


@lowering(run_and_save_rng_state)
def _run_and_save_rng_state(ctx: GraphBuilder, node):
    op, *args = node.args
    _check_op(op)
    state_meta = _state_meta(node)
    result_meta = _result_meta(node, op, args, node.kwargs)
    nested = isinstance(result_meta, (tuple, list))
    results = ctx.extern_call(
        SavedRngCall(op, nested),
        tuple(ctx.arg(a) for a in args),
        {k: ctx.arg(v) for k, v in node.kwargs.items()},
        (state_meta, *result_meta) if nested else (state_meta, result_meta),
        origin=f"run_and_save_rng_state({op_name(op)})",
    )
    results[0].device = state_meta.device  # a CPU byte tensor, whatever the graph's device
    return (results[0], tuple(results[1:])) if nested else (results[0], results[1])


@lowering(run_with_rng_state)
def _run_with_rng_state(ctx: GraphBuilder, node):
    state, op, *args = node.args
    _check_op(op)
    return ctx.extern_call(
        WithRngCall(op),
        (ctx.arg(state), *(ctx.arg(a) for a in args)),
        {k: ctx.arg(v) for k, v in node.kwargs.items()},
        _result_meta(node, op, args, node.kwargs),
        origin=f"run_with_rng_state({op_name(op)})",
    )
