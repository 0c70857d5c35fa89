"""Values a graph computes from constants alone, computed once when it is compiled.

A graph may build tensors that depend on no input: FlexAttention called without a BlockMask builds
one in the graph (factories, an `index_put`, a stable sort for the backward's transposed lists: five
kernels and four ATen calls at every forward, 0.3 ms of the host's time a call on an H200, for the
same few integers each time). Such values are computed here, on the graph's device, and read as
constants of the graph (FX `get_attr`; aten/importer.py reads them as constant externs), so the
host program no longer computes them.

What is folded: calls of ATen (and prims) operators, and `getitem` of their tuples, whose arguments
are all constants (literals, captured tensors, other folded values), with static sizes, no randomness,
no write to an argument, no uninitialized memory (`empty`), and no data-dependent size, where folding
saves work: a value computed by more than what ember's kernels inline (factories, pointwise ops,
views: a scalar, a causal mask stay inlined), or read where a tensor must exist (a graph output, a
higher-order op). A custom op is never run here (it may count calls, or be a collective). A graph
with any in-place write but AOTAutograd's final copies into its inputs is left as it is.

A constant must never reach the caller, who may keep it and write it, which would reach later calls.
An output the caller gets (an inference graph's, a forward's user outputs) that is computed from
constants alone stays computed, and so does every constant it is computed from. A forward's saved
tensors may be constants, and a backward may return one as a gradient (a custom autograd.Function
passing a saved tensor through): `copy_saved_gradients` makes such a gradient a copy. Results above
`MAX_FOLDED_BYTES` in all stay computed too: a constant lives as long as the graph.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch import fx

from ember.frontend.fx_nodes import ancestors

# The bytes of folded results a graph may hold (FlexAttention's BlockMask lists at 16,384 tokens
# take a few KiB).
MAX_FOLDED_BYTES = 1 << 20

_UNINITIALIZED = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
    torch.ops.aten.empty_permuted.default,
}


def fold_constants(gm: fx.GraphModule, user_outputs: int | None = None) -> int:
    """Compute `gm`'s values that depend on no input and read them as constants; returns how many
    were folded. `user_outputs`: the outputs before this position are the caller's (all of them
    where None); those after (a training forward's saved tensors) only autograd reads."""
    if any(_writes(n) for n in gm.graph.nodes):
        return 0
    constant: set[fx.Node] = set()
    for node in gm.graph.nodes:
        captured = node.op == "get_attr" and _real(getattr(gm, node.target, None))
        if captured or (node.op == "call_function" and _foldable(node, constant)):
            constant.add(node)
    constant -= _handed_out(gm, constant, user_outputs)
    # The constants that something left computed reads get values of their own where that saves work, within
    # the bytes allowed (one over them stays computed, and so do the constants it reads).
    frontier, held = [], 0
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        read = n in constant and n.op == "call_function" and any(user not in constant for user in n.users)
        if (
            read
            and isinstance(val, torch.Tensor)
            and held + _bytes(val) <= MAX_FOLDED_BYTES
            and _saves_work(n, constant)
        ):
            frontier.append(n)
            held += _bytes(val)
    if not frontier:
        return 0
    values = _evaluate(gm, frontier)
    names = [f"_ember_folded_{k}" for k in range(len(frontier))]
    for name, node in zip(names, frontier):
        gm.register_buffer(name, values[node], persistent=False)
    for name, node in zip(names, frontier):
        with gm.graph.inserting_before(node):
            replacement = gm.graph.get_attr(name)
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return len(frontier)


# Ops ember's kernels compute where they are read, from indices alone: a value made of these and read only by
# such ops costs nothing to leave computed (a scalar, a causal mask), and as a constant it would be a load.
_INLINED = {
    torch.ops.aten.full.default,
    torch.ops.aten.scalar_tensor.default,
    torch.ops.aten.zeros.default,
    torch.ops.aten.ones.default,
    torch.ops.aten.full_like.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.arange.default,
    torch.ops.aten.arange.start,
    torch.ops.aten.arange.start_step,
    torch.ops.aten.tril.default,
    torch.ops.aten.triu.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.lift_fresh_copy.default,
}


def _inlined(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem or target in _INLINED:
        return True
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or torch.Tag.pointwise in target.tags)


def _saves_work(node: fx.Node, constant: set[fx.Node]) -> bool:
    """Whether folding `node` removes work from every call: it is computed by something more than what kernels
    inline (a sort, a scatter), or it is read where a tensor must exist (a graph output, a higher-order op such
    as flex_attention: a launch a call only to write it)."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen or n not in constant or n.op != "call_function":
            continue
        seen.add(n)
        if not _inlined(n):
            return True
        todo += n.all_input_nodes
    readers = [user for user in node.users if user not in constant]
    return any(user.op == "output" or isinstance(user.target, torch._ops.HigherOrderOperator) for user in readers)


def _writes(node: fx.Node) -> bool:
    """A call that writes an argument, other than AOTAutograd's copy into an input."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target is torch.ops.aten.copy_.default and getattr(node.args[0], "op", None) == "placeholder":
        return False
    return target._schema.is_mutable


def _foldable(node: fx.Node, constant: set[fx.Node]) -> bool:
    target = node.target
    if target is operator.getitem:
        return node.args[0] in constant
    if not isinstance(target, torch._ops.OpOverload) or target in _UNINITIALIZED:
        return False
    if target.namespace not in ("aten", "prims"):  # a custom op may have effects (a counter, a collective)
        return False
    tags = set(target.tags)
    if torch.Tag.nondeterministic_seeded in tags or torch.Tag.dynamic_output_shape in tags:
        return False
    if target._schema.is_mutable or not _static(node.meta.get("val")):
        return False
    arguments = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
    if any(isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) for a in arguments):
        return False
    return all(a in constant for a in arguments if isinstance(a, fx.Node))


def _real(value: Any) -> bool:
    """A tensor with memory behind it (not a fake or meta one, which a compile may capture)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and not value.is_meta


def _static(val: Any) -> bool:
    """A tensor, or a tuple of them, of static sizes and strides."""
    if isinstance(val, (tuple, list)):
        return bool(val) and all(_static(v) for v in val)
    if not isinstance(val, torch.Tensor):
        return False
    return all(isinstance(s, int) for s in (*val.shape, *val.stride()))


def _handed_out(gm: fx.GraphModule, constant: set[fx.Node], user_outputs: int | None) -> set[fx.Node]:
    """The constants the caller could reach: an output before `user_outputs` that is a constant, and every
    constant it is computed from. Not only views: `_unsafe_view` and `unsafe_split` return views with no alias
    annotation, and AOTAutograd writes a reshape of a non-contiguous tensor as `clone` then `_unsafe_view`."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    todo = _nodes(list(results if user_outputs is None else results[:user_outputs]))
    reached: set[fx.Node] = set()
    while todo:
        node = todo.pop()
        if node not in reached and node in constant:
            reached.add(node)
            todo += node.all_input_nodes
    return reached


def _nodes(arguments: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arguments, lambda a: found.append(a) or a)
    return found


def _bytes(val: torch.Tensor) -> int:
    return val.untyped_storage().nbytes() if not val.is_meta else val.numel() * val.element_size()


def _evaluate(gm: fx.GraphModule, wanted: list[fx.Node]) -> dict[fx.Node, torch.Tensor]:
    """The values of `wanted`, computed on real tensors: each needed node run once, in graph order."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    needed = ancestors(wanted)
    env: dict[fx.Node, Any] = {}
    with unset_fake_temporarily(), torch.no_grad():
        for node in gm.graph.nodes:
            if node not in needed:
                continue
            if node.op == "get_attr":
                env[node] = getattr(gm, node.target)
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
            env[node] = node.target(*args, **kwargs)
    return {node: env[node] for node in wanted}


# Ops whose result may share its input's memory besides those with an alias annotation (`is_view`).
_ALIASING = {
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
}
_ALIASING_SPLITS = {
    torch.ops.aten.unsafe_split.Tensor,
    torch.ops.aten.unsafe_split_with_sizes.default,
    torch.ops.aten.unsafe_chunk.default,
}


def copy_saved_gradients(gm: fx.GraphModule) -> int:
    """A backward graph's gradients that are (views of) a saved tensor, as copies: a saved tensor may be a
    forward's folded constant, which a gradient handed to the caller must not be. Returns how many."""
    saved = {n for n in gm.graph.nodes if n.op == "placeholder" and "tangents" not in n.name}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    copied = 0
    for k, result in enumerate(results):
        if isinstance(result, fx.Node) and _base(result) in saved:
            with gm.graph.inserting_before(output):
                copy = gm.graph.call_function(torch.ops.aten.clone.default, (result,))
            val = result.meta.get("val")
            if isinstance(val, torch.Tensor):
                with val.fake_mode if hasattr(val, "fake_mode") else contextlib.nullcontext():
                    copy.meta["val"] = torch.ops.aten.clone.default(val)
            results[k] = copy
            copied += 1
    if copied:
        output.args = (type(output.args[0])(results) if isinstance(output.args[0], (tuple, list)) else results[0],)
        gm.recompile()
    return copied


def _base(node: fx.Node) -> fx.Node:
    """The node whose memory `node`'s result may share (itself, where it is computed anew)."""
    while node.op == "call_function":
        target = node.target
        if target is operator.getitem and getattr(node.args[0], "target", None) in _ALIASING_SPLITS:
            node = node.args[0].args[0]
        elif target in _ALIASING or (isinstance(target, torch._ops.OpOverload) and target.is_view):
            node = node.args[0]
        else:
            break
    return node


__all__ = ["MAX_FOLDED_BYTES", "copy_saved_gradients", "fold_constants"]
