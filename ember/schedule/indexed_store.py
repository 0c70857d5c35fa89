"""Indexed stores: a write into rows of a mutated graph input, done by the kernel computing the rows.

A static KV cache's update, `cache.index_copy_(2, pos, k)` or `cache[:, :, pos] = k`, reaches the
scheduler as an extern (`index_copy` / `index_put` of the cache) whose result is the input's new
value, which the importer marks to run in place (aten/inplace.py). As an ATen call, the rows `k`
must be stored first and copied by a second launch. Where the target renders indexed stores
(`Target.indexed_stores`), this pass turns such an extern into a value that a kernel computes over
the rows' shape and stores at `cache[..., pos[j], ...]` (kernel.KRow): `k` itself (the rotary
embedding of a projection) is inlined into that kernel and never reaches memory, and the cache is
written where it is, with no copy.

Taken only where the write can be nothing but in place, since the kernel writes just the named rows:
the input's new value is not returned, it has the input's layout, and nothing else in the graph reads
the input's old value (then no step can run between a read of the old rows and their overwrite). The
row position is checked against the input's size in the kernel, as eager's device-side check does;
index_put's negative positions count from the end, as in eager.

Not taken for an integer or bool input: the bounds check compiles the kernel in Triton's debug mode,
which also checks integer arithmetic for overflow that eager lets wrap. Not taken under
`torch.use_deterministic_algorithms(True)`: repeated positions are then written in a defined order by
ATen, and by racing programs in a kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ember import config
from ember.ir.graph import Node, Value, layout_of
from ember.schedule.kernel import IndexedStore
from ember.schedule.realize import view_chain

if TYPE_CHECKING:
    from ember.schedule.state import ScheduleState

aten = torch.ops.aten


def plan_indexed_stores(state: ScheduleState) -> None:
    """Record in `state.indexed_stores` the scatter-like externs into graph inputs that a kernel
    stores instead (the module's docstring says when)."""
    state.indexed_stores = {}
    if not state.target.indexed_stores or not config.get("indexed_stores"):
        return
    if torch.are_deterministic_algorithms_enabled():
        return
    graph = state.graph
    mutated: dict[Value, Value] = {}
    for inp, pos in graph.mutations:
        mutated[graph.outputs[pos]] = inp
    if len(mutated) < len(graph.mutations):
        return  # one value is two inputs' new value: the memory plan copies it into each (memory.py)
    returned = {id(v) for v in graph.user_outputs() if isinstance(v, Value)}
    readers: dict[Value, int] = {}
    for node in graph.nodes:
        for v in {view_chain(x)[0] for x in node.value_inputs()}:
            readers[v] = readers.get(v, 0) + 1
    for node in graph.nodes:
        store = _indexed_store(node)
        if store is None or mutated.get(store.new) is not store.dst or id(store.new) in returned:
            continue
        if readers.get(store.dst, 0) != 1 or not store.dst.dtype.is_floating_point:
            continue
        if tuple(layout_of(store.new)) != tuple(layout_of(store.dst)) or store.src.dtype != store.dst.dtype:
            continue
        state.indexed_stores[store.new] = store


def _indexed_store(node: Node) -> IndexedStore | None:
    """The indexed store an extern is, if it writes a graph input (aten/inplace.py's mark) at the rows
    one 1-d integer index names along one dim."""
    if node.op != "extern" or "writes_input" not in node.attrs:
        return None
    target, args, kwargs = node.attrs["target"], node.attrs["args"], node.attrs["kwargs"] or {}
    dst = node.attrs["writes_input"]
    new = node.outputs[0]
    if target is aten.index_copy.default and len(args) == 4 and not kwargs:
        _, dim, index, src = args
        wrap = False
    elif target is aten.index_put.default and 3 <= len(args) <= 4 and not kwargs:
        _, indices, src = args[:3]
        if (len(args) == 4 and args[3]) or not isinstance(indices, (list, tuple)):
            return None  # accumulate=True adds: not a store
        given = [k for k, i in enumerate(indices) if i is not None]
        if len(given) != 1:
            return None
        dim, index, wrap = given[0], indices[given[0]], True
    else:
        return None
    if not isinstance(dim, int) or not isinstance(index, Value) or not isinstance(src, Value):
        return None
    rank = len(dst.shape)
    dim = dim + rank if dim < 0 else dim
    if not 0 <= dim < rank or len(index.shape) != 1 or index.dtype not in (torch.int64, torch.int32):
        return None
    if any(x.device != dst.device for x in (index, src)):
        return None
    rows = tuple(index.shape[0] if d == dim else s for d, s in enumerate(dst.shape))
    if not _broadcasts(tuple(src.shape), rows) or (target is aten.index_copy.default and tuple(src.shape) != rows):
        return None
    return IndexedStore(new, dst, index, src, dim, wrap, rows)


def _broadcasts(shape: tuple, to: tuple) -> bool:
    if len(shape) > len(to):
        return False
    return all(s == 1 or s == t for s, t in zip(shape[::-1], to[::-1]))
