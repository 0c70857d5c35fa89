"""Memory planning: which buffer each kernel output lives in, and the peak that results.

Walking the schedule in order, each value a kernel writes takes, in this order of preference:

1. **in place**: the memory of a buffer the same kernel reads for the last time, when every
   load of it reads exactly the element the store writes (so no program reads an element
   another has overwritten), with the same dtype and room enough;
2. **a dead buffer**: the smallest freed buffer of the same dtype with room enough (graph
   outputs, and values a view keeps, only take one of their own footprint, the same bytes in
   any shape: the user holds an output's whole allocation), where the memory it holds idle
   (since its last use) or unused (beyond the value's bytes) keeps every step within the peak
   of a placement that frees every dead buffer instead (plan_memory);
3. **fresh memory**.

A mutated graph input's new value (graph.mutations) goes straight into the input where the
kernel computing it is the input's last user (see _Uses.mutated_input), or where an extern wrote it
there itself (a scatter made in place by the importer, `writes_input`).

Buffers are freed after their last use (a functional collective's inputs: after its wait), except
storage that a view may still read (alias bases, operands of view-returning externs), graph inputs
(the caller's) and outputs.
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
import torch

from ember.ir.graph import Graph, Value, layout_of
from ember.ir.sizes import Expr, product
from ember.schedule import collectives
from ember.schedule.cost import size_hint
from ember.schedule.gemm import is_gemm_kernel
from ember.schedule.kernel import Kernel, KLoad, kernel_parts, subtree, walk
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
    summed = {id(n) for c in kernel.column_partials for n in subtree(c.arg)}
    if summed:
        row_roots = [s.value for s in kernel.stores] + [r.arg for r in kernel.reduces]
        summed -= {id(n) for root in row_roots for n in subtree(root)}
        if any(id(n) in summed for n in loads):
            return False
    if not loads or not all(n.index == store.index and n.full == store.full for n in loads):
        return False
    if store.phase == kernel.num_phases - 1:
        return True
    if store.full:
        return False
    elsewhere = {id(n) for other in kernel.stores if other is not store for n in subtree(other.value)}
    return not any(id(n) in elsewhere for n in loads)


# Externs whose every result is a fresh allocation ATen made for it (no storage shared with an
# input, none kept by ATen): the matrix products and convolutions whose results epilogues read.
_FRESH_RESULTS = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "convolution_backward",
    "_convolution_pointwise",
    "_linear_pointwise",
}


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
    """Place every buffer the steps write, in order (see the module's docstring), and the peak.

    A dead buffer that a later value takes stays allocated until then, idle, and a value smaller than
    the buffer it takes holds the rest for nothing; freed instead, the memory would go back to the
    allocator. So the steps are placed twice: first with no dead buffer reused (the live bytes at every
    step, as the allocator would have them), then taking a dead buffer only where the bytes it holds
    idle or unused, as counted from that first placement, keep every step within its peak. The count
    is an estimate (an in-place successor may keep a larger buffer longer), so of the two placements
    the one with the lower peak is kept. (transformers' ResNet-50 at batch 64 had four idle 26 MB
    buffers and a 19 MB one held across its peak: 328 MB planned, 231 MB now.) Symbolic sizes give no
    peak: there every dead buffer that fits is taken."""
    uses = _uses(graph, steps)
    fresh = _place(uses, steps, reuse=False)
    if fresh.profile is None:
        return _place(uses, steps, reuse=True).plan(eager_peak_bytes)
    placed = _place(uses, steps, reuse=True, within=(fresh.profile, fresh.peak))
    return (placed if placed.peak <= fresh.peak else fresh).plan(eager_peak_bytes)


@dataclass
class _Placed:
    """One placement of the steps: the plan, its peak and its live bytes per step (None if symbolic)."""

    memory: MemoryPlan
    peak: int | None
    peak_values: frozenset  # values in memory at the peak
    profile: list[int] | None

    def plan(self, eager_peak_bytes: int | None) -> MemoryPlan:
        self.memory.peak_bytes, self.memory.peak_live = self.peak, self.peak_values
        self.memory.eager_peak_bytes = eager_peak_bytes
        return self.memory


def _place(uses: _Uses, steps: list[Step], reuse: bool, within: tuple[list[int], int] | None = None) -> _Placed:
    """Place the steps' buffers; `reuse`: dead buffers may be taken; `within`: (live bytes per step,
    a limit) that no dead buffer taken may raise any step's live bytes above."""
    placer = _Placer(uses, MemoryPlan(), reuse_dead=reuse, length=len(steps))
    if within is not None:
        placer.live, placer.limit = list(within[0]), within[1]
    for pos, step in enumerate(steps):
        placer.place(step, pos)
        placer.release_dead(step, pos)
    peak, peak_values, profile = _planned_peak(uses, placer.holder, placer.born, len(steps))
    return _Placed(placer.plan, peak, peak_values, profile)


@dataclass
class _Uses:
    """What placement asks of a value: where it is last used, and whether its memory may be recycled."""

    device: torch.device
    outputs: set[Value]
    user_outputs: list[Value]
    last: dict[Value, int]  # value -> the last step that reads or writes it
    shared: set[Value]  # storage a view may still read: never recycled
    mutated: dict[Value, Value]  # a mutated graph input's new value -> the input

    def recyclable(self, v: Value) -> bool:
        return v.node.op != "input" and v not in self.outputs and v not in self.shared

    def reusable(self, v: Value) -> bool:
        """A kernel's output, or a matrix product's or convolution's result: an epilogue after
        cuBLAS or cuDNN may write over the product, as Inductor's does (ResNet-50's batch norm and
        ReLU over each convolution's result)."""
        return v.node.op != "extern" or _fresh_extern_result(v, self.device)

    def mutated_input(self, v: Value, kernel: Kernel, pos: int) -> Value | None:
        """The graph input `v` is the new value of, where the kernel at `pos` may write v straight
        into it: it is the last step to use the input (reading it, if at all, element for element)
        and nothing else needs v in its own memory. Otherwise the host program copies v in at the end."""
        inp = self.mutated.get(v)
        if inp is None or v in self.user_outputs or inp in self.shared or not same_layout(inp, v):
            return None
        last = self.last.get(inp, -1)
        if last > pos or (last == pos and not _elementwise_reader(kernel, inp, v)):
            return None
        return inp

    def extern_in_place(self, step: ExternStep, pos: int, holder: dict[Value, Value]) -> Value | None:
        """The graph input a scatter-like extern may write in place (aten/inplace.py: `writes_input`):
        no later step reads the input's old value, itself or through a view, and the new value is not
        returned (a forward graph's saved value must not change when the caller writes the input)."""
        inp = step.node.attrs.get("writes_input")
        if (
            inp is None
            or step.node.outputs[0] in self.user_outputs
            or self.mutated.get(step.node.outputs[0]) is not inp
        ):
            return None
        views = [v for v, h in holder.items() if h is inp]
        if self.last.get(inp, -1) > pos or any(self.last.get(v, -1) >= pos for v in views):
            return None
        return inp


def _uses(graph: Graph, steps: list[Step]) -> _Uses:
    last: dict[Value, int] = {}
    for pos, step in enumerate(steps):
        for v in step_inputs(step) + step_outputs(step):
            last[v] = pos
    collectives.hold_inputs(steps, last)  # a collective in flight still reads its inputs
    shared: set[Value] = set()
    for step in steps:
        if isinstance(step, AliasStep):
            shared |= {step.base, step.value}
        elif isinstance(step, ExternStep) and may_alias(step.node):
            shared |= set(step.node.value_inputs()) | set(step.node.outputs)
    mutated = {graph.outputs[pos]: inp for inp, pos in graph.mutations}
    if len(mutated) < len(graph.mutations):
        mutated = {}  # one value for two inputs: each gets a copy
    outputs = {o for o in graph.outputs if isinstance(o, Value)}
    user_outputs = [o for o in graph.user_outputs() if isinstance(o, Value)]
    return _Uses(graph.device, outputs, user_outputs, last, shared, mutated)


@dataclass
class _Placer:
    """The walk over the steps: which memory each written value takes."""

    uses: _Uses
    plan: MemoryPlan
    holder: dict[Value, Value] = field(default_factory=dict)  # value -> the value that first allocated its memory
    born: dict[Value, int] = field(default_factory=dict)  # memory holder -> step that allocates it
    free: list[Value] = field(default_factory=list)  # dead buffers whose memory a later output may take
    reuse_dead: bool = True  # False: no dead buffer is taken (each goes back to the allocator)
    length: int = 0  # steps placed: a graph output lives to this one
    sizes: dict[Value, int] = field(default_factory=dict)  # bytes, as size hints, computed once per value
    freed_at: dict[Value, int] = field(default_factory=dict)  # dead buffer -> the step of its last use
    # With a limit: the live bytes at each step, counting what the dead buffers taken so far hold idle
    # or unused, which no further one may raise above `limit`.
    live: list[int] | None = None
    limit: int | None = None

    def place(self, step: Step, pos: int) -> None:
        if isinstance(step, KernelStep):
            taken: set[Value] = set()  # buffers an output of this kernel already writes over in place
            parts = kernel_parts(step.kernel)
            for part in parts:
                # A combo kernel's parts run side by side: none writes over memory another reads.
                others = {v for p in parts if p is not part for v in p.reads}
                for v in part.writes:
                    self._place_output(part, v, pos, taken, others)
        elif isinstance(step, AliasStep):
            self.holder[step.value] = self.holder.get(step.base, step.base)
        elif isinstance(step, ExternStep):
            written = self.uses.extern_in_place(step, pos, self.holder)
            if written is not None:
                self.plan.mutations_in_place.add(written)
            for v in step.node.outputs:
                if written is not None:
                    self.holder[v] = written  # the caller's memory: not counted in the peak
                    continue
                self.holder[v] = v
                self.born[v] = pos

    def _place_output(self, kernel: Kernel, v: Value, pos: int, taken: set[Value], others: set[Value]) -> None:
        rows = [s for s in kernel.stores if s.row is not None and s.buffer is v]
        # A scatter-add's buffer is zeroed before the kernel runs (codegen/host.py): never memory it reads.
        added = bool(rows) and all(s.accumulate for s in rows)
        inp = None if added else self.uses.mutated_input(v, kernel, pos)
        if inp is not None and inp not in others and self.holder.get(inp, inp) not in self._gemm_operands(kernel):
            self.plan.reuse[v] = inp
            self.plan.inplace.add(v)
            self.plan.mutations_in_place.add(inp)
            self.holder[v] = inp  # the caller's memory: not counted in the peak
            return
        if rows and not added:
            # It writes only the rows an index names: anywhere but in its input, the rest would be unset.
            # indexed_store.py takes a scatter only where this cannot happen.
            raise RuntimeError(f"the rows of %{v.name} must be stored into their input, and cannot be")
        donor = None if added else self._in_place_donor(kernel, v, pos, taken | others)
        if donor is not None:
            self.plan.inplace.add(v)
            taken.add(donor)
        else:
            donor = self._dead_buffer(v, pos)
        if donor is not None:
            self.plan.reuse[v] = donor
            self.holder[v] = self.holder[donor]
        else:
            self.holder[v] = v
            self.born[v] = pos

    def _room(self, u: Value, v: Value) -> bool:
        """Whether v may take u's memory. An output (or a value a view keeps) takes only memory
        allocated at its own size: the caller keeps the whole allocation alive, so a small output
        (a batch-norm weight's gradient) must not pin a large buffer handed down through a chain of
        reuses. Same footprint, other shape is fine: a GELU over a [2048, 3072] product written as
        [4, 512, 3072] reuses the product's memory instead of taking a second buffer."""
        if self.uses.recyclable(v):
            return _fits(u, v)
        return _same_footprint(u, v) and _same_footprint(self.holder[u], v)

    def _gemm_operands(self, kernel: Kernel) -> set[Value]:
        """The memory of a GEMM template's operands, which no output of it may be written over (in place of a
        dead operand, or as a mutated input's new value): its tiles read whole rows of A and columns of B,
        which an epilogue that also reads one of them element by element (`u + u @ w`, `x.add_(x @ w)`)
        would overwrite under other tiles."""
        if not is_gemm_kernel(kernel):
            return set()
        return {self.holder.get(x, x) for x in (kernel.gemm.a, kernel.gemm.b)}

    def _in_place_donor(self, kernel: Kernel, v: Value, pos: int, taken: set[Value]) -> Value | None:
        """A buffer the kernel reads for the last time, element for element, that v can overwrite (never a
        GEMM template's operand: `_gemm_operands`)."""
        uses = self.uses
        operands = self._gemm_operands(kernel)
        for u in kernel.reads:
            if (
                u in self.holder and uses.last[u] == pos and uses.recyclable(u) and uses.reusable(u)
                and u not in taken and self.holder[u] not in operands and self._room(u, v)
                and _elementwise_reader(kernel, u, v)
            ):  # fmt: skip
                return u
        return None

    def _dead_buffer(self, v: Value, pos: int) -> Value | None:
        """The smallest dead buffer with room for v that keeps every step within the limit, taken off
        the free list. One whose idle stretch alone would pass the limit goes off the list for good: the
        stretch only grows, and the bytes counted in it too."""
        if not self.reuse_dead:
            return None
        for donor in sorted((u for u in self.free if self._room(u, v)), key=lambda u: size_hint(extent(u))):
            idle_fits, fits = self._within_limit(donor, v, pos)
            if not idle_fits:
                self.free.remove(donor)
            elif fits:
                self.free.remove(donor)
                return donor
        return None

    def _bytes(self, v: Value) -> int:
        if v not in self.sizes:
            self.sizes[v] = size_hint(nbytes(v))
        return self.sizes[v]

    def _within_limit(self, u: Value, v: Value, pos: int) -> tuple[bool, bool]:
        """Whether the dead buffer u, held idle from its last use to `pos`, keeps those steps within the
        limit, and whether v may take it at `pos`: also with the bytes beyond v's own while v lives. When
        it may, both are counted in `live`."""
        if self.live is None:
            return True, True
        held = self._bytes(self.holder[u])
        unused = held - self._bytes(v)
        idle = range(self.freed_at[u] + 1, pos)
        if idle and max(self.live[idle.start : idle.stop]) + held > self.limit:
            return False, False
        stop = self.length if v in self.uses.outputs else self.uses.last.get(v, pos)
        if unused and max(self.live[pos : stop + 1]) + unused > self.limit:
            return True, False
        for s in idle:
            self.live[s] += held
        for s in range(pos, stop + 1):
            self.live[s] += unused
        return True, True

    def release_dead(self, step: Step, pos: int) -> None:
        """Free the recyclable buffers whose last use is this step (unless an output took them)."""
        uses = self.uses
        for v in step_inputs(step) + step_outputs(step):
            dead = uses.last[v] == pos and uses.recyclable(v) and uses.reusable(v) and v in self.holder
            if dead and not any(self.plan.reuse.get(w) is v for w in step_outputs(step)):
                self.free.append(v)
                self.freed_at[v] = pos


def _planned_peak(
    uses: _Uses, holder: dict[Value, Value], born: dict[Value, int], length: int
) -> tuple[int | None, frozenset, list[int] | None]:
    """The peak bytes of the placed memory, the values in memory live at the peak (none if
    symbolic), and the bytes live at each step (None if symbolic). Each holder's memory lives from
    its allocation to the last use of anything kept in it (a buffer reusing it, a view of it); graph
    outputs and views of inputs live to the end."""
    died: dict[Value, int] = {}
    for v, h in holder.items():
        if h not in born:
            continue  # a view of a graph input: the caller's memory
        stop = length if v in uses.outputs else uses.last.get(v, born[h])
        died[h] = max(died.get(h, born[h]), stop)
    intervals = [(nbytes(h), born[h], died[h]) for h in born]
    profile = _profile(intervals, length)
    if profile is None:
        return None, frozenset(), None
    peak = max(profile, default=0)
    if peak == 0:
        return 0, frozenset(), profile
    at = profile.index(peak)
    return peak, frozenset(v for v, h in holder.items() if h in born and born[h] <= at <= died[h]), profile


def _profile(intervals: list[tuple[Expr, int, int]], length: int) -> list[int] | None:
    """The bytes of the intervals [start, stop] covering each position (None if symbolic)."""
    delta = [0] * (length + 2)
    for size, start, stop in intervals:
        size = sympy.sympify(size)
        if not size.is_Integer:
            return None
        delta[start] += int(size)
        delta[stop + 1] -= int(size)
    out, live = [], 0
    for d in delta:
        live += d
        out.append(live)
    return out


def _peak(intervals: list[tuple[Expr, int, int]], length: int) -> int | None:
    """Max over positions of the bytes of intervals [start, stop] covering it; None if symbolic."""
    profile = _profile(intervals, length)
    return None if profile is None else max(profile, default=0)


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
    return _peak(intervals, end)


def describe_mutations(graph: Graph, steps: list[Step], plan: MemoryPlan) -> list[str]:
    """One line per mutated graph input: the step that writes its new value into it, or why the
    host program copies it in at the end."""
    writer: dict[Value, str] = {}
    for step in steps:
        if isinstance(step, KernelStep):
            writer.update(dict.fromkeys(step.kernel.writes, f"kernel {step.kernel.name}"))
        elif isinstance(step, ExternStep):
            writer.update(dict.fromkeys(step.node.outputs, f"extern {step.node.origin}"))
    uses = _uses(graph, steps)
    lines = []
    for inp, pos in graph.mutations:
        new = graph.outputs[pos]
        name = f"input {inp.node.attrs['index']} ({inp.type_str})"
        by = writer.get(new, "a view")
        if inp in plan.mutations_in_place:
            lines.append(f"{name}: written in place by {by}")
        else:
            lines.append(f"{name}: computed by {by}, copied in at the end ({_copy_reason(uses, inp, new)})")
    return lines


def _copy_reason(uses: _Uses, inp: Value, new: Value) -> str:
    if uses.mutated.get(new) is not inp:
        return "its new value is another input's too, or a view"
    if new in uses.user_outputs:
        return "its new value is also returned"
    if inp in uses.shared:
        return "a view of the input is read"
    if not same_layout(inp, new):
        return "its new value is computed in another layout"
    if new.node.op == "extern" and "writes_input" not in new.node.attrs:
        return f"an ATen call ({new.node.origin}) computes it"
    return "the input's old value is read after its new value is computed"
