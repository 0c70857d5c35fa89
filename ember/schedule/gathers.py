"""Gathers: rows of a tensor read at the positions an index tensor holds, by the kernels that read them.

`x.index_select(0, idx)`, `embedding(weight, ids)`, `x[:, idx]`, `x[i, j]` and `x.gather(d, idx)` (the gradient
of a scatter-add) reach the scheduler as ATen externs.
Run as ATen calls, each gathered tensor is written to memory and read back by the next kernel: a graph
network's messages `x[src] * w` over a million edges are stored as a [edges, features] tensor before they
are scaled and summed. Where the target renders indexed rows (`Target.indexed_rows`), this pass makes such
an extern a value that kernels compute where they read it (kernel_builder.KernelBuilder.gather): the
index is loaded, its position checked against the source's size as eager's device-side check does, and
the source read there. The source may itself be computed in the kernel (read at those rows), and the
gathered value is stored only where something outside a kernel needs it (realize.py).

A gather is taken when its index is an integer tensor on the source's device, and the result has the
source's dtype (not bool: Triton holds bools in memory as bytes). Indexing wraps negative positions as
eager's indexing does; index_select and embedding reject them, as eager does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ember import config
from ember.ir.graph import Node, Value
from ember.schedule.kernel import Gather

if TYPE_CHECKING:
    from ember.schedule.state import ScheduleState

aten = torch.ops.aten

_INDEX_DTYPES = (torch.int64, torch.int32)


def plan_gathers(state: ScheduleState) -> None:
    """Record in `state.gathers` the externs that kernels compute as gathers (the module's docstring)."""
    state.gathers = {}
    if not state.target.indexed_rows or not config.get("gathers"):
        return
    for node in state.graph.nodes:
        gather = _gather(node)
        if gather is not None:
            state.gathers[gather.value] = gather


def _gather(node: Node) -> Gather | None:
    """The gather an extern is, if it reads one source at the positions integer tensors hold along adjacent dims."""
    if node.op != "extern" or len(node.outputs) != 1 or "writes_input" in node.attrs:
        return None
    target, args, kwargs = node.attrs["target"], node.attrs["args"], node.attrs["kwargs"] or {}
    if target is aten.index_select.default and len(args) == 3 and not kwargs:
        src, dim, index = args
        wrap = False
        if not isinstance(index, Value) or len(index.shape) != 1:
            return None
    elif target is aten.embedding.default and 2 <= len(args) <= 5 and not kwargs:
        src, index = args[:2]
        dim, wrap = 0, False
    elif target is aten.gather.default and len(args) == 3 and not kwargs.get("sparse_grad"):
        return _gather_per_element(node.outputs[0], *args)
    elif target is aten.index.Tensor and len(args) == 2 and not kwargs:
        return _indexing(node.outputs[0], *args)
    else:
        return None
    value = node.outputs[0]
    if not isinstance(src, Value) or not isinstance(index, Value) or not isinstance(dim, int):
        return None
    rank = len(src.shape)
    dim = dim + rank if dim < 0 else dim
    if not 0 <= dim < rank or index.dtype not in _INDEX_DTYPES or index.device != src.device:
        return None
    if value.dtype != src.dtype or src.dtype == torch.bool or src.dtype.is_complex:
        return None
    expected = (*src.shape[:dim], *index.shape, *src.shape[dim + 1 :])
    if tuple(value.shape) != tuple(expected):
        return None
    return Gather(value, src, index, dim, wrap, tuple(index.shape))


def _indexing(value: Value, src, indices) -> Gather | None:
    """`src[..., i, j, ...]`: integer index tensors at adjacent dims, broadcast together (negative positions
    wrap). Index tensors apart from each other move their dims to the front in eager: not taken."""
    if not isinstance(src, Value) or not isinstance(indices, (list, tuple)):
        return None
    given = [k for k, i in enumerate(indices) if i is not None]
    if not given or given != list(range(given[0], given[-1] + 1)):
        return None
    tensors = [indices[k] for k in given]
    if not all(isinstance(t, Value) and t.dtype in _INDEX_DTYPES and t.device == src.device for t in tensors):
        return None
    if value.dtype != src.dtype or src.dtype == torch.bool or src.dtype.is_complex:
        return None
    dim = given[0]
    if len(tensors) == 1:
        rows = tuple(tensors[0].shape)
    else:
        rows = _broadcast_shape([tuple(t.shape) for t in tensors])
        if rows is None:
            return None
    expected = (*src.shape[:dim], *rows, *src.shape[dim + len(tensors) :])
    if tuple(value.shape) != tuple(expected):
        return None
    return Gather(value, src, tensors[0], dim, True, rows, more=tuple(tensors[1:]))


def _broadcast_shape(shapes: list[tuple]) -> tuple | None:
    """The shape the index tensors broadcast to, where each size is 1 or the result's (statically)."""
    rank = max(len(s) for s in shapes)
    out = []
    for d in range(rank):
        sizes = {s[len(s) - rank + d] for s in shapes if len(s) - rank + d >= 0} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _gather_per_element(value: Value, src, dim, index) -> Gather | None:
    """torch.gather: shaped as its index, each element read where the index holds along `dim`. Taken where
    the index has the source's size along every other dim (eager allows smaller)."""
    if not isinstance(src, Value) or not isinstance(index, Value) or not isinstance(dim, int):
        return None
    rank = len(src.shape)
    dim = dim + rank if dim < 0 else dim
    if rank == 0 or not 0 <= dim < rank or len(index.shape) != rank or index.dtype not in _INDEX_DTYPES:
        return None
    if any(index.shape[d] != src.shape[d] for d in range(rank) if d != dim) or index.device != src.device:
        return None
    if value.dtype != src.dtype or src.dtype == torch.bool or src.dtype.is_complex:
        return None
    return Gather(value, src, index, dim, False, tuple(index.shape), per_element=True)
