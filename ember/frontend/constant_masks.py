"""SDPA masks built from constants only, evaluated when the graph is compiled.

A mask whose builders are factories, compares, shape ops and cumsum (no graph input among them, and
none written in place) has one value for every call: it is evaluated here, on the CPU, and what it
keeps decides whether SDPA may run as `is_causal=True` or without a mask (patterns.py:
`constant_sdpa_masks`; the attention matcher asks the same of a written-out attention's mask).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx

from ember.frontend.fx_nodes import aliases, call_arg, example_value, is_call, mutates


class _NotConstant(Exception):
    pass


def _require(cond: bool) -> None:
    if not cond:
        raise _NotConstant


# Ops a mask may be built from to be evaluated here: factories and shape/compare ops only.
_CONST_FUNCS = {
    torch.ones,
    torch.zeros,
    torch.full,
    torch.arange,
    torch.tril,
    torch.triu,
    torch.logical_not,
    torch.where,
    torch.masked_fill,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.invert,
    operator.getitem,
    operator.sub,
    operator.add,
    operator.neg,
    operator.and_,
    operator.or_,
    torch.diff,
    torch.cumsum,
}
_CONST_METHODS = {
    "tril",
    "triu",
    "bool",
    "float",
    "to",
    "view",
    "reshape",
    "unsqueeze",
    "expand",
    "logical_not",
    "masked_fill",
    "__getitem__",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "cumsum",
    "diff",
    # the operators as methods: how torch 2.11's Dynamo records `a == b` on some tensors
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__invert__",
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__neg__",
    "new_ones",
    "new_zeros",
    "new_full",
    "__and__",
    "__or__",
}
# A value evaluated here holds at most this many bytes of storage (an expanded view counts its
# storage, not its broadcast elements): transformers' [8, 1, 2048, 2048] boolean mask is 32 MiB.
_MAX_CONST_BYTES = 1 << 26


def _constant(node: fx.Node, memo: dict) -> Any:
    """Evaluate `node` on the CPU if it is built from constants only; raises _NotConstant otherwise."""
    if node in memo:
        return memo[node]
    _require(is_call(node, _CONST_FUNCS, _CONST_METHODS))

    def value(a):
        if isinstance(a, fx.Node):
            return _constant(a, memo)
        if isinstance(a, (tuple, list)):
            return type(a)(value(x) for x in a)
        if isinstance(a, slice):
            return slice(value(a.start), value(a.stop), value(a.step))
        _require(a is None or isinstance(a, (int, float, bool, torch.dtype, torch.device, str, type(...))))
        return a

    args = value(node.args)
    kwargs = {k: (torch.device("cpu") if k == "device" else value(a)) for k, a in node.kwargs.items()}
    if node.op == "call_method":
        self, *rest = args
        if node.target == "to":
            rest = [a for a in rest if not isinstance(a, (torch.device, str))]
        result = getattr(self, node.target)(*rest, **kwargs)
    else:
        result = node.target(*args, **kwargs)
    _require(not isinstance(result, torch.Tensor) or result.untyped_storage().nbytes() <= _MAX_CONST_BYTES)
    memo[node] = result
    return result


def sdpa_constant_mask(sdpa: fx.Node, memo: dict[fx.Node, tuple | None] | None = None) -> str | None:
    """What an SDPA call's `attn_mask`, when built from constants only, keeps: "causal" (exactly
    the lower triangle of a square score matrix, in every batch and head), "all" (every score), or
    None (not constant, not evaluable here, or any other pattern). `memo` (one per graph) keeps
    what each mask keeps: transformers' layers share one mask.

    A boolean mask keeps its True entries. A float mask keeps its zeros and may mask with -inf or
    its dtype's most negative value (transformers masks with `finfo(dtype).min`): a causal row
    always keeps its diagonal, so no row is left without a kept score, and a masked score's exponent
    (the score plus that value, minus the row's maximum) underflows to zero in softmax unless
    scores reach the value's magnitude (65504 for float16, 3.4e38 for bfloat16 and float32)."""
    memo = {} if memo is None else memo
    node = call_arg(sdpa, 3, "attn_mask")
    if node not in memo:
        mask = evaluated(node)
        memo[node] = None
        if mask is not None and (mask.dtype == torch.bool or mask.is_floating_point()):
            fill = None if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
            memo[node] = (keeps(mask, fill), tuple(mask.shape[-2:]))
    q, k = example_value(call_arg(sdpa, 0, "query")), example_value(call_arg(sdpa, 1, "key"))
    if memo[node] is None or q is None or k is None or q.dim() < 2:
        return None
    pattern, last_two = memo[node]
    if pattern == "causal" and not square(q.shape[-2], k.shape[-2], last_two):
        return None
    return pattern


def evaluated(node: Any) -> torch.Tensor | None:
    """`node`'s value, where it is a tensor of at least two dims built from constants only, none of
    which the graph writes in place (`m.tril_()`, `m[:, 5:] = False`: the node reads the value
    before the write, the SDPA call after it)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if not isinstance(node, fx.Node) or _written_in_place(constant_ancestors(node)):
        return None
    try:
        with unset_fake_temporarily():
            value = _constant(node, {})
    except _NotConstant:
        return None
    except (RuntimeError, TypeError, ValueError, IndexError):  # not evaluable here: not known
        return None
    return value if isinstance(value, torch.Tensor) and value.dim() >= 2 else None


def _written_in_place(nodes: list[fx.Node]) -> bool:
    """Whether an in-place op writes any of `nodes` or a value derived from them by the ops a
    constant is built from (a view of it: `m.view(8, 8).tril_()`)."""
    seen, todo = set(nodes), list(nodes)
    while todo:
        for user in todo.pop().users:
            if mutates(user):
                return True
            if user not in seen and (is_call(user, _CONST_FUNCS, _CONST_METHODS) or aliases(user)):
                seen.add(user)
                todo.append(user)
    return False


def keeps(mask: torch.Tensor, masked_fill: float | None = None) -> str | None:
    """ "all", "causal" or None for a boolean mask (kept: True), or for a float mask (kept: 0;
    masked: -inf, or `masked_fill` where given)."""
    if mask.dtype == torch.bool:
        keep = mask
    else:
        masked = mask == -math.inf
        if masked_fill is not None:
            masked |= mask == masked_fill
        keep = mask == 0
        if not bool((keep | masked).all()):
            return None
    if bool(keep.all()):
        return "all"
    L, S = keep.shape[-2:]
    return "causal" if bool(torch.equal(keep, torch.ones(L, S, dtype=torch.bool).tril().expand_as(keep))) else None


def square(L: Any, S: Any, last_two: tuple) -> bool:
    """is_causal aligns the triangle top-left; only claim it where L == S, so that cannot matter."""
    return isinstance(L, int) and isinstance(S, int) and L == S and tuple(last_two) == (L, S)


def constant_ancestors(node: fx.Node) -> list[fx.Node]:
    """The nodes a constant mask is built from (itself included), which a causal rewrite leaves unread."""
    seen, todo = [], [node]
    while todo:
        n = todo.pop()
        if n not in seen and is_call(n, _CONST_FUNCS, _CONST_METHODS):
            seen.append(n)
            todo.extend(n.all_input_nodes)
    return seen
