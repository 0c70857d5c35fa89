"""Realize: decide which values live in memory.

Graph outputs, extern inputs and reduction results do (`realize_stored`); pointwise values and
views do not: they are recomputed or re-indexed inside each kernel that reads them. A view that
must exist as a tensor (an output, an extern's input) is, where its layout allows, an alias: a
strided view of its base's buffer, so only the base is realized. Pointwise values read by
several kernels join them where computing them once moves fewer bytes, and values with
transcendental work that a reader broadcasts widely where computing them once saves that work,
or whose inlined expression loads so many buffers that each reader would re-run a long chain
(`realize_shared`).
"""

from __future__ import annotations

import sympy
import torch

from ember.ir.graph import Node, Value, layout_of
from ember.ir.ops import POINTWISE
from ember.ir.sizes import index_symbol, product
from ember.ir.views import VIEW_KINDS, strides_of
from ember.schedule.cost import size_hint
from ember.schedule.state import ScheduleState
from ember.schedule.steps import AliasStep
from ember.target import Target


def view_chain(value: Value) -> tuple[Value, list[Node]]:
    """The non-view root of a value and the view nodes from root to value."""
    chain = []
    while value.node.op == "view":
        chain.append(value.node)
        value = value.node.inputs[0]
    return value, list(reversed(chain))


def realize_stored(state: ScheduleState) -> None:
    """Values that are stored whatever fuses (outputs, extern inputs, alias bases), and reductions."""
    graph = state.graph
    # A scatter's rows are written by its own kernel, which no reader of the result can join; a
    # scatter-add's initial value is copied into its buffer by the host.
    needed = [o for o in graph.outputs if isinstance(o, Value)] + list(state.indexed_stores)
    needed += [s.initial for s in state.indexed_stores.values() if s.initial is not None]
    for node in graph.nodes:
        if state.is_extern(node):
            needed += node.value_inputs()
    realized: list[Value] = []
    for v in needed:
        if not state.computed_by_kernel(v):
            continue
        if v.node.op == "view":
            root, _ = view_chain(v)
            layout = _alias_layout(v, root, layout_of(root))
            if layout is not None:
                state.aliases[v] = AliasStep(v, root, *layout)
                if state.computed_by_kernel(root):
                    realized.append(root)
                continue
        realized.append(v)
    # Read by an extern or kept as an alias's base: stored whatever fuses.
    state.read_outside = set(realized) | {a.base for a in state.aliases.values()}
    for node in graph.nodes:
        if state.is_extern(node):
            state.read_outside |= {view_chain(v)[0] if v in state.aliases else v for v in node.value_inputs()}
    realized += [node.out for node in graph.nodes if node.op == "reduce"]
    state.realized = realized


def realize_shared(state: ScheduleState) -> None:
    """Pointwise values worth computing once: read by several consumers, and built from several
    buffers whose bytes outweigh the value's (`worth_storing`). Inlining those into every
    consumer would re-read all their inputs each time (a residual stream inlined into each
    layer's norm grows with depth).
    A realized value costs nothing when its consumers fuse with it: it is stored only if a
    kernel outside its own reads it.

    Also worth computing once: a value whose expression holds transcendental work (sin, erf,
    sigmoid, ...) and that a reader broadcasts over a much larger domain (`costly_to_broadcast`). Inlined,
    every element of the reader evaluates it again: rotary embeddings' cos and sin of a [tokens,
    rotary dims] table, recomputed in the backward by AOTAutograd's partitioner, were evaluated
    once per head and per q/k/v column of the fused gradient.
    """
    realized = set(state.realized)
    users: dict[Value, int] = {}
    for node in state.graph.nodes:
        if node.op == "view":
            continue  # not a reader: its own readers are counted at the root
        # A node that reads a value twice (x * x) is one reader: it fuses with it once.
        for root in {view_chain(v)[0] for v in node.value_inputs()}:
            users[root] = users.get(root, 0) + 1
    widest = _widest_reads(state.graph)
    reads: dict[Value, frozenset] = {}
    work: dict[Value, int] = {}  # flops per element of a value's inlined expression
    for node in state.graph.nodes:
        if node.op in ("full", "iota"):
            # Computed from the loop position alone: no buffer to re-read (nll_loss's
            # where(t != ignore_index, t, 0) reads only t).
            reads[node.out] = frozenset()
            continue
        if node.op not in ("pointwise", "cast"):
            continue
        v = node.out
        touched: set = set()
        for x in node.value_inputs():
            root, _ = view_chain(x)
            touched |= reads.get(root, {root})
        # Buffers much smaller than v (batch norm's per-channel mean under x - mean) are re-read
        # from cache by each consumer: only buffers of about v's size make inlining costly.
        large = [b for b in touched if 8 * size_hint(product(b.shape)) >= size_hint(product(v.shape))]
        flops = POINTWISE[node.attrs["fn"]].flops if node.op == "pointwise" else 0
        if (
            state.target.heuristics.realize.free_positions
            and not touched
            and not any(x.dtype.is_floating_point for x in (v, *node.value_inputs()))
        ):
            flops = 0  # integer arithmetic on loop positions alone (a padding's inside-the-image test)
        # Summed per read path (a shared subexpression counts once per path), so capped.
        work[v] = min(MAX_WORK, flops + sum(work.get(view_chain(x)[0], 0) for x in node.value_inputs()))
        if (
            v in realized
            or worth_storing(users.get(v, 0), [b.dtype.itemsize for b in large], v.dtype.itemsize)
            or costly_to_broadcast(work[v], size_hint(product(v.shape)), widest.get(v, 0), state.target)
            or recomputed_in_many_readers(users.get(v, 0), work[v], state.target)
            or loads_too_many(users.get(v, 0), len(touched), state.target)
        ):
            if v not in realized:
                state.realized.append(v)
            reads[v] = frozenset({v})
            work[v] = 0
        else:
            reads[v] = frozenset(touched)


MAX_WORK = 1 << 20  # flops per element: past any threshold, and far from a float's range


def costly_to_broadcast(work: int, elements: int, widest_reader: int, target: Target) -> bool:
    """Whether inlining a value of `elements` elements whose expression costs `work` flops each
    into a reader of `widest_reader` elements would evaluate transcendental work many times over
    (target.heuristics.realize), for longer than a launch takes on `target` (where it knows its
    rates). Computed once, the value costs a small write and reads that mostly hit the cache."""
    h = target.heuristics.realize
    if work < h.broadcast_min_flops or elements <= 0 or widest_reader < h.broadcast_factor * elements:
        return False
    if elements == 1 and not h.scalars_per_element:
        return False  # a scalar in each thread of the reader, not a value an element
    if not target.flop_rate or not target.launch_seconds:
        return True
    return (widest_reader - elements) * work / target.flop_rate >= target.launch_seconds


def recomputed_in_many_readers(readers: int, work: int, target: Target) -> bool:
    """Whether a value with arithmetic of its own, read by many kernels or by one kernel's many terms
    (a max pool's nine window positions over a batch norm and ReLU), is computed once, where the
    target asks (`heuristics.realize.shared_readers`: the C++ target's). Inlined in C++, each term
    evaluated it again through loads that do not vectorize (a stride-2 window): ResNet's stem pool
    took 8.8 ms against 2.6 ms reading the stored activation on 2 cores. On a GPU the recomputation
    hides under the loads, so there bytes decide (`worth_storing`)."""
    h = target.heuristics.realize
    if 0 < h.costly_min_flops <= work and readers >= 2:
        return True
    return 0 < h.shared_readers <= readers and work >= h.shared_min_flops


def loads_too_many(readers: int, loads: int, target: Target) -> bool:
    """Whether a value read by several kernels inlines loads of so many buffers
    (`heuristics.realize.inlined_loads`) that each reader would re-run a long chain of them."""
    return readers >= 2 and loads >= target.heuristics.realize.inlined_loads


def _widest_reads(graph) -> dict[Value, int]:
    """For each value, the largest domain (elements) in which some node reads it through views:
    the reader's output, or the view it reads (an expand is read at its full size)."""
    widest: dict[Value, int] = {}
    for node in graph.nodes:
        if node.op == "view":
            continue
        out = max((size_hint(product(o.shape)) for o in node.outputs if isinstance(o, Value)), default=0)
        for x in node.value_inputs():
            root = view_chain(x)[0]
            size = max(out, size_hint(product(x.shape)))
            if size > widest.get(root, 0):
                widest[root] = size
    return widest


def worth_storing(readers: int, large_itemsizes: list[int], itemsize: int) -> bool:
    """Whether a pointwise value read by `readers` kernels is cheaper stored once than recomputed
    in each, counting bytes per element: recomputing re-reads its large inputs in every reader;
    storing reads them once, writes the value, and each reader but the one that fuses with it
    (usually one does) reads it back. Ties store (a residual stream, x + a in bf16).

    Batch norm's backward `where(relu_mask, 0, grad)` (1 + 2 bytes in, 2 out) is recomputed by
    its two readers: after a split neither fuses with it, and storing it cost a write and two
    reads of the gradient's size per layer. Two large inputs at least: one input is never worth a
    buffer of its own."""
    if readers < 2 or len(large_itemsizes) < 2:
        return False
    return (readers - 1) * sum(large_itemsizes) >= readers * itemsize


def _alias_layout(value: Value, root: Value, root_stride) -> tuple | None:
    """Strides and offset of `value` as a strided view of root's buffer, if it is one."""
    _, chain = view_chain(value)
    static = all(e.is_Integer for e in tuple(root.shape) + tuple(root_stride))
    if static and all(e.is_Integer for node in chain for e in node.out.shape):
        return _static_alias_layout(chain, root, root_stride)

    def index_fn(index):
        for node in reversed(chain):
            base = node.inputs[0]
            index = VIEW_KINDS[node.attrs["kind"]].index(index, base.shape, node.out.shape, node.attrs)
        return index

    syms = [index_symbol(f"a{k}") for k in range(len(value.shape))]
    return strides_of(index_fn, value.shape, root_stride, syms)


_META_VIEWS = {
    "permute": lambda t, a: t.permute(a["dims"]),
    "expand": lambda t, a: t.expand([int(s) for s in a["shape"]]),
    "reshape": lambda t, a: t.view([int(s) for s in a["shape"]]),
    "slice": lambda t, a: torch.ops.aten.slice(t, a["dim"], int(a["start"]), int(a["end"]), int(a["step"])),
    "select": lambda t, a: t.select(a["dim"], int(a["index"])),
    "unsqueeze": lambda t, a: t.unsqueeze(a["dim"]),
    "squeeze": lambda t, a: t.squeeze(a["dims"]) if a["dims"] else t,
}


def _static_alias_layout(chain: list[Node], root: Value, root_stride) -> tuple | None:
    """The same question for static shapes, answered by torch's own view rules on a meta tensor
    (much faster than the symbolic route; `view` raises where a reshape would need a copy)."""
    t = torch.empty_strided([int(s) for s in root.shape], [int(s) for s in root_stride], device="meta")
    try:
        for node in chain:
            t = _META_VIEWS[node.attrs["kind"]](t, node.attrs)
    except RuntimeError:
        return None
    return tuple(sympy.Integer(s) for s in t.stride()), sympy.Integer(t.storage_offset())
