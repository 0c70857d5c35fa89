"""Activation checkpointing's RNG ops: `run_and_save_rng_state(op, *args)` gives the default
generator's state and op's result; `run_with_rng_state(state, op, *args)` runs op with the generator
at that state and puts it back. torch.utils.checkpoint wraps each random op of a checkpointed region
in them (an op tagged nondeterministic_seeded: dropout, SDPA), so that the backward's recomputation
draws what the forward drew.

Each becomes one extern step that calls the higher-order op itself (torch's own implementation per
device: the state is a CPU byte tensor, read and set on the host), with its nested result
(state, (out, ...)) flattened for the step and rebuilt for the getitems that read it. Under CUDA
graphs such a step is a reason not to capture (runtime/cudagraphs.py): it reads the generator's
state on the host.
"""

from __future__ import annotations

import operator

import torch
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


def _result_meta(node):
    """The node's recorded value; where the partitioner made the node without one (it does for these
    ops), the tuple its getitem users' values spell, None at positions no user reads."""
    val = node.meta.get("val")
    if val is not None:
        return val
    parts = {u.args[1]: u.meta.get("val") for u in node.users if u.target is operator.getitem}
    if not parts or len(parts) != len(node.users) or any(v is None for v in parts.values()):
        raise Unsupported(f"{node.name}: no recorded value")
    return tuple(parts.get(k) for k in range(max(parts) + 1))


@lowering(run_and_save_rng_state)
def _run_and_save_rng_state(ctx: GraphBuilder, node):
    op, *args = node.args
    _check_op(op)
    meta = _result_meta(node)
    if len(meta) != 2 or meta[1] is None:
        raise Unsupported(f"{node.name}: its result is not read")
    state_meta, result_meta = meta
    nested = isinstance(result_meta, (tuple, list))
    flat_meta = (state_meta, *result_meta) if nested else (state_meta, result_meta)
    results = ctx.extern_call(
        SavedRngCall(op, nested),
        tuple(ctx.arg(a) for a in args),
        {k: ctx.arg(v) for k, v in node.kwargs.items()},
        flat_meta,
        origin=f"run_and_save_rng_state({op_name(op)})",
    )
    return (results[0], tuple(results[1:])) if nested else (results[0], results[1])


@lowering(run_with_rng_state)
def _run_with_rng_state(ctx: GraphBuilder, node):
    state, op, *args = node.args
    _check_op(op)
    return ctx.extern_call(
        WithRngCall(op),
        (ctx.arg(state), *(ctx.arg(a) for a in args)),
        {k: ctx.arg(v) for k, v in node.kwargs.items()},
        _result_meta(node),
        origin=f"run_with_rng_state({op_name(op)})",
    )
