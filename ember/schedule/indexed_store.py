"""Indexed stores: a write into rows of a mutated graph input, or a scatter-add, done by the kernel computing
the rows.

A static KV cache's update, `cache.index_copy_(2, pos, k)` or `cache[:, :, pos] = k`, reaches the
scheduler as an extern (`index_copy` / `index_put` of the cache) whose result is the input's new
value, which the importer marks to run in place (aten/inplace.py). As an ATen call, the rows `k`
must be stored first and copied by a second launch. Where the target renders indexed stores
(`Target.indexed_rows`), this pass turns such an extern into a value that a kernel computes over
the rows' shape and stores at `cache[..., pos[j], ...]` (kernel.KRow): `k` itself (the rotary
embedding of a projection) is inlined into that kernel and never reaches memory, and the cache is
written where it is, with no copy.

Taken only where the write can be nothing but in place, since the kernel writes just the named rows:
the input's new value is not returned, it has the input's layout, and nothing else in the graph reads
the input's old value (then no step can run between a read of the old rows and their overwrite). The
row position is checked against the input's size in the kernel, as eager's device-side check does;
index_put's negative positions count from the end, as in eager.

Not taken for an integer or bool input: such caches are rare and are left to ATen's call. Not taken under
`torch.use_deterministic_algorithms(True)`: repeated positions are then written in a defined order by
ATen, and by racing programs in a kernel.

A scatter-add (setting `scatter_adds`) adds values at the rows an index names: a graph network's messages
summed into their target nodes (`zeros.scatter_add_(0, dst, msg)`), a mixture of experts' outputs combined
into the tokens' rows (`index_add_`), an embedding's gradient (`index_put_(..., accumulate=True)`). The kernel
computing the values adds them with atomic adds (`KStore.accumulate`) into a buffer the host program zeroes,
or fills with the initial value where that is not zeros, just before the launch: the values never reach
memory of their own. Programs add in any order, as eager's CUDA kernels do; only the dtypes the target adds
atomically (`Target.atomic_adds`).
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
    """Record in `state.indexed_stores` the scatter-like externs that a kernel stores or adds instead
    (the module's docstring says when)."""
    state.indexed_stores = {}
    if not state.target.indexed_rows or torch.are_deterministic_algorithms_enabled():
        return
    if config.get("scatter_adds") and state.target.row_stores:
        for node in state.graph.nodes:
            store = _scatter_add(node, state.target)
            if store is not None:
                state.indexed_stores[store.new] = store
    if config.get("indexed_stores") and state.target.row_stores:
        _plan_input_stores(state)


def _plan_input_stores(state: ScheduleState) -> None:
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
        if (len(args) == 4 and args[3]) or _one_index(indices) is None:
            return None  # accumulate=True adds: not a store
        (dim, index), wrap = _one_index(indices), True
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


def _scatter_add(node: Node, target) -> IndexedStore | None:
    """The accumulating store an extern is, if it adds values into zeros at the rows an integer index
    names along one dim: scatter_add (an index per element), index_add and index_put(accumulate=True)
    (an index per row)."""
    if node.op != "extern" or len(node.outputs) != 1 or "writes_input" in node.attrs:
        return None
    fn, args, kwargs = node.attrs["target"], node.attrs["args"], node.attrs["kwargs"] or {}
    new = node.outputs[0]
    per_element = False
    if fn is aten.scatter_add.default and len(args) == 4 and not kwargs:
        dst, dim, index, src = args
        per_element = True
    elif fn is aten.index_add.default and len(args) == 4 and (not kwargs or kwargs == {"alpha": 1}):
        dst, dim, index, src = args
    elif fn is aten.index_put.default and len(args) == 4 and args[3] is True and not kwargs:
        dst, indices, src = args[:3]
        if _one_index(indices) is None:
            return None
        dim, index = _one_index(indices)
    else:
        return None
    if not all(isinstance(x, Value) for x in (dst, index, src)) or not isinstance(dim, int):
        return None
    if new.dtype not in target.atomic_adds or src.dtype != new.dtype or dst.dtype != new.dtype:
        return None
    if not _zeros(dst) and dst.node.op == "view":
        return None  # the host copies the initial value from a buffer of its own
    rank = len(dst.shape)
    dim = dim + rank if dim < 0 else dim
    if not 0 <= dim < rank or index.dtype not in (torch.int64, torch.int32) or tuple(new.shape) != tuple(dst.shape):
        return None
    if any(x.device != dst.device for x in (index, src)):
        return None
    if per_element:
        rows = tuple(index.shape)
        # Eager requires index.size(d) <= dst.size(d) off `dim`; equal sizes are checked statically.
        fits = len(rows) == rank and all(r == s for d, (r, s) in enumerate(zip(rows, dst.shape)) if d != dim)
        if not fits or tuple(src.shape) != rows:
            return None
    else:
        if len(index.shape) != 1:
            return None
        rows = tuple(index.shape[0] if d == dim else s for d, s in enumerate(dst.shape))
        if not _broadcasts(tuple(src.shape), rows):
            return None
    wrap = fn is aten.index_put.default  # indexing counts negative positions from the end
    initial = None if _zeros(dst) else dst
    return IndexedStore(
        new, dst, index, src, dim, wrap, rows, accumulate=True, per_element=per_element, initial=initial
    )


def _one_index(indices) -> tuple[int, object] | None:
    """(dim, index) where index_put's indices name one dim by one tensor, else None."""
    if not isinstance(indices, (list, tuple)):
        return None
    given = [k for k, i in enumerate(indices) if i is not None]
    return (given[0], indices[given[0]]) if len(given) == 1 else None


def _zeros(v: Value) -> bool:
    """Whether v is zeros made in the graph (new_zeros, zeros_like, full(0))."""
    node = v.node
    return node.op == "full" and not isinstance(node.attrs.get("value"), bool) and node.attrs.get("value") == 0


def _broadcasts(shape: tuple, to: tuple) -> bool:
    if len(shape) > len(to):
        return False
    return all(s == 1 or s == t for s, t in zip(shape[::-1], to[::-1]))
