"""Reading nodes of Dynamo's Torch-level FX graph: which function or method a node calls, its
arguments by position or name, the FakeTensor Dynamo recorded for it, and whether it writes an
input. Shared by the attention matcher and the constant-mask fold."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

_INPLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imatmul,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.setitem,
}


def is_call(node: Any, funcs: set, methods: set) -> bool:
    """Whether `node` calls one of `funcs`, or one of `methods` by name."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in funcs
    return node.op == "call_method" and node.target in methods


def example_value(node: Any):
    """The FakeTensor Dynamo recorded for `node`, or None."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value")
    return v if isinstance(v, torch.Tensor) else None


def call_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    # A method's args[0] is self, so `x.softmax(dim)` and `F.softmax(x, dim)` index alike.
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def mutates(node: fx.Node) -> bool:
    """Whether the call writes one of its inputs (an in-place method or function, `x[i] = v`)."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_function":
        if getattr(node.target, "__module__", None) == "_operator":
            # Python's operators: `and_`, `or_` are pure despite the underscore; iadd, setitem write.
            return node.target in _INPLACE_OPERATORS
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


# Ops whose result may share its input's memory: an in-place write through one writes the input.
ALIAS_FUNCS = {
    getattr,  # x.T, x.mT
    operator.getitem,
    torch.transpose,
    torch.permute,
    torch.squeeze,
    torch.unsqueeze,
    torch.narrow,
    torch.select,
    torch.flatten,
    torch.reshape,
    torch.split,
    torch.chunk,
    torch.unbind,
    torch.movedim,
    torch.diagonal,
    torch.t,
    torch.detach,
    torch.as_strided,
}
ALIAS_METHODS = {
    "t",
    "transpose",
    "permute",
    "squeeze",
    "narrow",
    "select",
    "as_strided",
    "detach",
    "flatten",
    "unflatten",
    "view_as",
    "expand_as",
    "reshape_as",
    "split",
    "chunk",
    "unbind",
    "unfold",
    "diagonal",
    "movedim",
    "swapaxes",
    "swapdims",
    "contiguous",
    "type_as",
    # Conversions and views that return their input (or a view of it) where there is nothing to do.
    "view",
    "reshape",
    "unsqueeze",
    "expand",
    "to",
    "type",
    "bool",
    "float",
    "half",
    "bfloat16",
    "__getitem__",
}


def ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    """`nodes` and every node they read, directly or not."""
    seen: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return seen


def aliases(node: Any) -> bool:
    """Whether `node`'s result may share its first argument's memory (an in-place write through one
    writes the other)."""
    return is_call(node, ALIAS_FUNCS, ALIAS_METHODS)
