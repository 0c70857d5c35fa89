"""Memory planning: which buffer each kernel output lives in, and the peak that results.

Walking the schedule in order, each value a kernel writes takes, in this order of preference:

1. **in place**: the memory of a buffer the same kernel reads for the last time, when every
   load of it reads exactly the element the store writes (so no program reads an element
   another has overwritten), with the same dtype and room enough;
2. **a dead buffer**: the smallest freed buffer of the same dtype with room enough (graph
   outputs, and values a view keeps, only take one of their own footprint, the same bytes in
   any shape: the user holds an output's whole allocation);
3. **fresh memory**.

A mutated graph input's new value (graph.mutations) goes straight into the input where the
kernel computing it is the input's last user (see writes_in_place).

Buffers are freed after their last use, except storage that a view may still read (alias
bases, operands of view-returning externs), graph inputs (the caller's) and outputs.
Extern results are ATen's allocations, counted toward the peak; those of matrix products and
convolutions (fresh memory by contract) and of ember's targets marked `fresh_result` are reused
like kernel outputs, others never.

The planned peak is compared with eager's: the same graph run op by op, every non-view op
materializing its result, each freed after its last use. Both count intermediates and
outputs, not inputs. Symbolic sizes give no number (None).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from ember.ir.graph import Graph, Value, layout_of
from ember.ir.sizes import Expr, product
from ember.schedule.cost import size_hint
from ember.schedule.kernel import Kernel, KLoad, KNode, walk
from ember.schedule.steps import AliasStep, ExternStep, KernelStep, Step, may_alias, step_inputs, step_outputs


@dataclass
class MemoryPlan:
    # value -> the value whose memory it takes (in place or a dead buffer)
    reuse: dict[Value, Value] = field(default_factory=dict)
    inplace: set[Value] = field(default_factory=set)
    mutations_in_place: set[Value] = field(default_factory=set)  # mutated inputs written by a kernel
    peak_bytes: int | None = None
    eager_peak_bytes: int | None = None
    # Values whose memory is allocated at the step where the peak is reached (empty if symbolic).
    peak_live: frozenset = frozenset()

    def shared_buffers(self, kernel: Kernel) -> frozenset[Value]:
        """The buffers of `kernel` whose memory another of its buffers also uses: an output written
        in place of an input it reads (the input's last use, or a mutated graph input). Code
        generation must not tell the compiler they are distinct (C++ `__restrict__`): with it, GCC
        reordered the loads and stores of an in-place update that is also summed, and the sum read
        elements the kernel had already overwritten."""
        params = set(kernel.reads) | set(kernel.writes)
        by_memory: dict[Value, list[Value]] = {}
        for v in params:
            root = v
            while root in self.reuse:
                root = self.reuse[root]
            by_memory.setdefault(root, []).append(v)
        return frozenset(v for group in by_memory.values() if len(group) > 1 for v in group)

    def __str__(self) -> str:
        def mb(b):
            return "symbolic" if b is None else f"{b / 1e6:.2f} MB"

        return (
            f"planned peak {mb(self.peak_bytes)} (eager {mb(self.eager_peak_bytes)}); "
            f"{len(self.reuse) - len(self.inplace)} buffers reused, {len(self.inplace)} in place"
            + (f", {len(self.mutations_in_place)} mutated inputs written in place" if self.mutations_in_place else "")
        )


def extent(v: Value) -> Expr:
    """Elements of storage a value's layout spans."""
    return 1 + sum(((s - 1) * st for s, st in zip(v.shape, layout_of(v))), sympy.Integer(0))


def nbytes(v: Value) -> Expr:
    return sympy.Integer(0) if any(s == 0 for s in v.shape) else extent(v) * v.dtype.itemsize


def _fits(donor: Value, v: Value) -> bool:
    if donor.dtype != v.dtype:
        return False
    room = sympy.expand(extent(donor) - extent(v))
    return room == 0 or bool(room.is_nonnegative)


def same_layout(donor: Value, v: Value) -> bool:
    return (
        tuple(donor.shape) == tuple(v.shape)
        and tuple(layout_of(donor)) == tuple(layout_of(v))
        and (donor.dtype == v.dtype)
    )


def _same_footprint(a: Value, b: Value) -> bool:
    """Same dtype and element count, each dense in its own layout: the same bytes of storage, the
    same shape or not ([2048, 3072] and [4, 512, 3072])."""
    if a.dtype != b.dtype:
        return False
    numel_a, numel_b = product(a.shape), product(b.shape)
    return all(sympy.expand(d) == 0 for d in (numel_a - numel_b, extent(a) - numel_a, extent(b) - numel_b))


def _elementwise_reader(kernel: Kernel, buf: Value, out: Value) -> bool:
    """Whether every load of buf in kernel reads the element the store of out writes, and no
    pass over the row after the store's reads buf again (a looped reduction re-reads rows).

    A store before the last pass is safe only for a row value (one element per row, as batch
    norm's running statistics) whose loads of buf feed nothing but that store: code generation
    evaluates such a load before the store that needs it, and nothing later asks for it."""
    stores = [s for s in kernel.stores if s.buffer is out]
    if len(stores) != 1:
        return False  # a column sum's partials (kernel.KColumnPartial) are written after every row
    (store,) = stores
    loads = [n for n in walk(kernel) if isinstance(n, KLoad) and n.buffer is buf]
    # A column sum's terms are computed after the row's stores (codegen/triton.py): a load feeding
    # only them would read what the store just wrote over it. One the row's own values share is
    # loaded before the stores, and the terms reuse it.
    summed = {id(n) for c in kernel.column_partials for n in _subtree(c.arg)}
    if summed:
        row_roots = [s.value for s in kernel.stores] + [r.arg for r in kernel.reduces]
        summed -= {id(n) for root in row_roots for n in _subtree(root)}
        if any(id(n) in summed for n in loads):
            return False
    if not loads or not all(n.index == store.index and n.full == store.full for n in loads):
        return False
    if store.phase == kernel.num_phases - 1:
        return True
    if store.full:
        return False
    elsewhere = {id(n) for other in kernel.stores if other is not store for n in _subtree(other.value)}
    return not any(id(n) in elsewhere for n in loads)


def _subtree(node: KNode) -> list[KNode]:
    seen: dict[int, KNode] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen[id(n)] = n
            stack.extend(n.args())
    return list(seen.values())


# Externs whose every result is a fresh allocation ATen made for it (no storage shared with an
# input, none kept by ATen): the matrix products and convolutions whose results epilogues read.
_FRESH_RESULTS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward"}


def _fresh_extern_result(v: Value, device) -> bool:
    """Whether an extern's result is memory the program may write over once it is dead: produced
    by an op known to allocate it, on the graph's device, not empty. Others (views without alias
    annotations like `_unsafe_view`, constants, philox seeds on the CPU) are never reused."""
    target = v.node.attrs.get("target")
    name = getattr(getattr(target, "overloadpacket", None), "__name__", None)
    return (
        (name in _FRESH_RESULTS or getattr(target, "fresh_result", False))
        and not may_alias(v.node)
        and v.device == device
        and not any(sympy.sympify(s).is_Integer and int(s) == 0 for s in v.shape)
    )


def plan_memory(graph: Graph, steps: list[Step], eager_peak_bytes: int | None) -> MemoryPlan:
    outputs = {o for o in graph.outputs if isinstance(o, Value)}
    last: dict[Value, int] = {}
    for pos, step in enumerate(steps):
        for v in step_inputs(step) + step_outputs(step):
            last[v] = pos
    shared: set[Value] = set()  # storage a view may still read: never recycled
    for step in steps:
        if isinstance(step, AliasStep):
            shared |= {step.base, step.value}
        elif isinstance(step, ExternStep) and may_alias(step.node):
            shared |= set(step.node.value_inputs()) | set(step.node.outputs)
    plan = MemoryPlan()

    def recyclable(v: Value) -> bool:
        return v.node.op != "input" and v not in outputs and v not in shared

    def reusable(v: Value) -> bool:
        """A kernel's output, or a matrix product's or convolution's result: an epilogue after
        cuBLAS or cuDNN may write over the product, as Inductor's does (ResNet-50's batch norm and
        ReLU over each convolution's result)."""
        return v.node.op != "extern" or _fresh_extern_result(v, graph.device)

    # A mutated input's new value is written straight into the input when the kernel computing it
    # is the last step to use the input (reading it, if at all, element for element) and nothing
    # else needs the value in its own memory; otherwise the host program copies it in at the end.
    user_outputs = [o for o in graph.user_outputs() if isinstance(o, Value)]
    mutated = {graph.outputs[pos]: inp for inp, pos in graph.mutations}
    if len(mutated) < len(graph.mutations):
        mutated = {}  # one value for two inputs: each gets a copy

    def writes_in_place(v: Value, step: KernelStep, pos: int) -> Value | None:
        inp = mutated.get(v)
        if inp is None or v in user_outputs or inp in shared or not same_layout(inp, v):
            return None
        if last.get(inp, -1) > pos or (last.get(inp) == pos and not _elementwise_reader(step.kernel, inp, v)):
            return None
        return inp

    holder: dict[Value, Value] = {}  # value -> the value that first allocated its memory
    born: dict[Value, int] = {}  # memory holder -> step that allocates it
    free: list[Value] = []  # dead kernel outputs whose memory a later output may take
    for pos, step in enumerate(steps):
        if isinstance(step, KernelStep):
            taken: set[Value] = set()  # buffers an output of this kernel already writes over in place
            for v in step.kernel.writes:
                inp = writes_in_place(v, step, pos)
                if inp is not None:
                    plan.reuse[v] = inp
                    plan.inplace.add(v)
                    plan.mutations_in_place.add(inp)
                    holder[v] = inp  # the caller's memory: not counted in the peak
                    continue

                # An output (or a value a view keeps) takes only memory allocated at its own size:
                # the caller keeps the whole allocation alive (a batch-norm weight's 32-float
                # gradient once pinned a 1 MB activation buffer handed down through a chain of
                # reuses). Same footprint, other shape is fine: a GELU over a [2048, 3072] product
                # written as [4, 512, 3072] (each BERT layer's feed-forward took a second 100 MB).
                def room(u: Value, v: Value = v) -> bool:
                    if recyclable(v):
                        return _fits(u, v)
                    return _same_footprint(u, v) and _same_footprint(holder[u], v)

                donor = next(
                    (
                        u
                        for u in step.kernel.reads
                        if u in holder and last[u] == pos and recyclable(u) and reusable(u)
                        and u not in taken and room(u) and _elementwise_reader(step.kernel, u, v)
                    ),
                    None,
                )  # fmt: skip
                if donor is not None:
                    plan.inplace.add(v)
                    taken.add(donor)
                if donor is None:
                    fitting = [u for u in free if room(u)]
                    if fitting:
                        donor = min(fitting, key=lambda u: size_hint(extent(u)))
                        free.remove(donor)
                if donor is not None:
                    plan.reuse[v] = donor
                    holder[v] = holder[donor]
                else:
                    holder[v] = v
                    born[v] = pos
        elif isinstance(step, AliasStep):
            holder[step.value] = holder.get(step.base, step.base)
        elif isinstance(step, ExternStep):
            for v in step.node.outputs:
                holder[v] = v
                born[v] = pos
        for v in step_inputs(step) + step_outputs(step):
            if last[v] == pos and recyclable(v) and reusable(v) and v in holder:
                if not any(plan.reuse.get(w) is v for w in step_outputs(step)):
                    free.append(v)

    # Each holder's memory lives from its allocation to the last use of anything kept in it
    # (a buffer reusing it, a view of it); graph outputs and views of inputs live to the end.
    end = len(steps)
    died: dict[Value, int] = {}
    for v, h in holder.items():
        if h not in born:
            continue  # a view of a graph input: the caller's memory
        stop = end if v in outputs else last.get(v, born[h])
        died[h] = max(died.get(h, born[h]), stop)
    plan.peak_bytes, at = _peak([(nbytes(h), born[h], died[h]) for h in born], len(steps))
    if at is not None:
        plan.peak_live = frozenset(v for v, h in holder.items() if h in born and born[h] <= at <= died[h])
    plan.eager_peak_bytes = eager_peak_bytes
    return plan


def _peak(intervals: list[tuple[Expr, int, int]], length: int) -> tuple[int | None, int | None]:
    """Max over positions of the bytes of intervals [start, stop] covering it, and the first
    position where it is reached; (None, None) if symbolic."""
    delta = [0] * (length + 2)
    for size, start, stop in intervals:
        size = sympy.sympify(size)
        if not size.is_Integer:
            return None, None
        delta[start] += int(size)
        delta[stop + 1] -= int(size)
    peak = live = 0
    at = None
    for pos, d in enumerate(delta):
        live += d
        if live > peak:
            peak, at = live, pos
    return peak, at


def eager_peak(graph: Graph) -> int | None:
    """Peak bytes of the graph run op by op: each non-view op's result lives until its last use."""
    root: dict[Value, Value] = {}
    last: dict[Value, int] = {}
    for pos, node in enumerate(graph.nodes):
        for v in node.value_inputs():
            last[root.get(v, v)] = pos
        for v in node.outputs:
            root[v] = root.get(node.inputs[0], node.inputs[0]) if node.op == "view" else v
    end = len(graph.nodes)
    for o in graph.outputs:
        if isinstance(o, Value):
            last[root.get(o, o)] = end
    intervals = [
        (nbytes(v), pos, last.get(v, pos))
        for pos, node in enumerate(graph.nodes)
        if node.op not in ("view", "input")
        for v in node.outputs
    ]
    return _peak(intervals, end)[0]
