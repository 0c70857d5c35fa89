"""Scatter-like writes into a graph input, done in place by ATen (the reinplacing of a functional graph).

AOTAutograd hands over `cache.index_copy_(1, pos, k)` as `new = index_copy(cache, 1, pos, k)` followed by
`copy_(cache, new)`: run as written, that copies the whole cache twice to change one row. When the
scatter-like op reads the input it writes, the importer records the extern's in-place ATen form
(`index_copy_`, `index_put_`, `scatter_`, ...; for `slice_scatter`/`select_scatter` a copy of the source
into that view of the input). Where the schedule makes the extern the last step to read the input's old
value, the memory plan runs it in that form on the input itself: only the written elements move, as in
eager, and the input needs no copy at the end.
"""

from __future__ import annotations

import torch

from ember.ir.graph import Value

aten = torch.ops.aten

# Functional scatter-like ops whose in-place overload of the same name writes `self`.
_INPLACE = ("index_put", "index_copy", "index_add", "index_fill", "scatter", "scatter_add", "scatter_reduce")


def _inplace_overload(target):
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", None)
    if name not in _INPLACE:
        return None
    return getattr(getattr(aten, f"{name}_"), target._overloadname, None)


class _ViewAssign:
    """`slice_scatter`/`select_scatter` done in place: src copied into that view of the input."""

    fresh_result = False

    def __init__(self, kind: str):
        self.kind = kind
        self.__name__ = f"{kind}_assign"

    def __call__(self, base: torch.Tensor, src: torch.Tensor, dim: int = 0, *rest) -> torch.Tensor:
        if self.kind == "select":
            base.select(dim, rest[0]).copy_(src)
        else:
            start, end, step = (list(rest) + [None, None, 1])[:3]
            base[(slice(None),) * dim + (slice(start, end, step),)].copy_(src)
        return base

    def __eq__(self, other) -> bool:
        return isinstance(other, _ViewAssign) and other.kind == self.kind

    def __hash__(self) -> int:
        return hash(self.kind)


_VIEW_ASSIGN = {aten.slice_scatter.default: "slice", aten.select_scatter.default: "select"}


def mark_inplace(new: Value, dst: Value) -> bool:
    """Where the extern computing `new` (the input `dst`'s new value) is scatter-like over `dst`, record
    its in-place form (`attrs["inplace_target"]`) and the input it would write (`attrs["writes_input"]`);
    the memory plan uses it where the extern is the last step to read `dst`. Returns whether it did."""
    node = new.node
    if node.op != "extern" or len(node.outputs) != 1 or node.attrs.get("tuple_result"):
        return False
    target = node.attrs["target"]
    args = node.attrs["args"]
    inplace = _inplace_overload(target)
    if inplace is None and target in _VIEW_ASSIGN:
        inplace = _ViewAssign(_VIEW_ASSIGN[target])
    if inplace is None or not args or args[0] is not dst or sum(v is dst for v in node.value_inputs()) > 1:
        return False
    if new.dtype != dst.dtype or tuple(new.shape) != tuple(dst.shape):
        return False
    node.attrs["inplace_target"] = inplace
    node.attrs["writes_input"] = dst
    return True
