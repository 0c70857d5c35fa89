"""The cost model: what a kernel moves and computes, and how long that should take.

Bytes are counted as the device's memory sees them, not as the program names them:

- a load touches the distinct elements its index walks: a bias broadcast over [N, C] reads
  C elements, not N*C (the rest hit in cache); several loads of one buffer (q/k/v slices of
  one projection) touch at most the buffer;
- a looped reduction re-reads, in every pass over the row, the full-row loads that pass
  needs (softmax: one pass for the max, one for the sum, one to store); a persistent one
  holds the row and reads it once;
- a store writes the elements its index walks.

FLOPs count each pointwise op by its `ops.POINTWISE[...].flops` weight, at every point it is
computed (full values at every element, row values once per row), and each reduction update.

The roofline estimate is max(bytes / bandwidth, FLOPs / compute rate) plus a launch cost,
with the target's limits (ember/target.py; backends/device.py measures the bandwidth and looks
the compute rate up in the device's specification: vector, not tensor-core, math).
Symbolic sizes are evaluated at their hints when asked for a number.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ember import config
from ember.ir import ops
from ember.ir.sizes import Expr, product
from ember.schedule.kernel import ComboKernel, Kernel, KLoad, KNode, KOp, KReduce, walk
from ember.target import Target


@dataclass(frozen=True)
class KernelCost:
    bytes_read: Expr
    bytes_written: Expr
    flops: Expr

    @property
    def bytes(self) -> Expr:
        return self.bytes_read + self.bytes_written

    def __add__(self, other: KernelCost) -> KernelCost:
        return KernelCost(
            self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written, self.flops + other.flops
        )


def _footprint(index: Expr, kernel: Kernel) -> Expr:
    """Distinct elements an index walks: the product of the domain dims it depends on."""
    dom = kernel.domain
    used = index.free_symbols
    return product([s for v, s in zip(dom.vars(), dom.shape) if v in used])


def row_passes(kernel: Kernel, persistent: bool) -> list[list[KNode]]:
    """The nodes computed per element in each pass over the rows (one pass when persistent)."""
    if persistent or kernel.num_phases <= 1:
        return [[n for n in walk(kernel) if n.full]]
    passes = []
    for phase in range(kernel.num_phases):
        roots = [r.arg for r in kernel.reduces if r.phase == phase]
        roots += [s.value for s in kernel.stores if s.full and s.phase == phase]
        seen: dict[int, KNode] = {}
        stack = list(roots)
        while stack:  # values of earlier phases' reductions are per row: stop at them
            n = stack.pop()
            if id(n) in seen or isinstance(n, KReduce) or not n.full:
                continue
            seen[id(n)] = n
            stack.extend(n.args())
        passes.append(list(seen.values()))
    return passes


def _min(a: Expr, b: Expr) -> Expr:
    """min(a, b); sympy's Min only where a size is symbolic (it is slow even on two integers)."""
    if a.is_Integer and b.is_Integer:
        return min(a, b)
    return sympy.Min(a, b)


def is_persistent(kernel: Kernel) -> bool:
    """Whether the target holds a whole row at once (see codegen launch configs)."""
    rnumel = product([s for s, r in zip(kernel.loop_sizes, kernel.loop_reduce) if r])
    if not rnumel.is_Integer:
        return False
    return 1 << (int(rnumel) - 1).bit_length() <= config.get("persistent_reduction_max")


def kernel_cost(kernel: Kernel, persistent: bool | None = None, stored: set | None = None) -> KernelCost:
    """The kernel's cost; `stored` limits the written bytes to those buffers (while fusing, a
    kernel stores all it computes; only what someone else reads will be stored in the end)."""
    if isinstance(kernel, ComboKernel):  # its parts' traffic and work, in one launch
        zero = sympy.Integer(0)
        return sum((kernel_cost(p, None, stored) for p in kernel.parts), KernelCost(zero, zero, zero))
    if persistent is None:
        persistent = is_persistent(kernel)
    outer = product(kernel.domain.outer_shape)
    numel = product(kernel.domain.shape)
    nodes = walk(kernel)

    # Reads: each buffer's footprint, once for row-level loads and persistent rows, and once per
    # pass that needs it for the full-row loads of a looped reduction.
    footprint: dict = {}
    for n in nodes:
        if isinstance(n, KLoad):
            footprint.setdefault(n.buffer, []).append(n)
    passes = row_passes(kernel, persistent)
    read = sympy.Integer(0)
    for buf, loads in footprint.items():
        cap = product(buf.shape)
        row_loads = [n for n in loads if not n.full]
        full_loads = [n for n in loads if n.full]
        elems = sympy.Integer(0)
        if row_loads:
            elems += _min(cap, sum((_footprint(n.index, kernel) for n in row_loads), sympy.Integer(0)))
        if full_loads:
            one_pass = _min(cap, sum((_footprint(n.index, kernel) for n in full_loads), sympy.Integer(0)))
            ids = {id(n) for n in full_loads}
            times = sum(1 for p in passes if any(id(n) in ids for n in p)) or 1
            elems += times * one_pass
        read += elems * buf.dtype.itemsize
    written = sum(
        (
            _footprint(s.index, kernel) * s.buffer.dtype.itemsize
            for s in kernel.stores
            if stored is None or s.buffer in stored
        ),
        sympy.Integer(0),
    )
    # Column sums accumulated by the row loop write one partial row per chunk of rows.
    written += sum(
        (
            product(c.buffer.shape) * c.buffer.dtype.itemsize
            for c in kernel.column_partials
            if stored is None or c.buffer in stored
        ),
        sympy.Integer(0),
    )

    flops = sympy.Integer(0)
    for p in passes:
        flops += numel * sum(ops.POINTWISE[n.fn].flops for n in p if isinstance(n, KOp))
    flops += outer * sum(ops.POINTWISE[n.fn].flops for n in nodes if isinstance(n, KOp) and not n.full)
    flops += numel * (len(kernel.reduces) + len(kernel.column_partials))
    cost = KernelCost(sympy.sympify(read), sympy.sympify(written), sympy.sympify(flops))
    extra = getattr(kernel, "extra_cost", None)  # work its expression DAG does not show (a GEMM's K loop)
    return cost + extra() if extra is not None else cost


def size_hint(expr: Expr) -> int:
    """A size or byte count as a number for comparing and ranking: symbolic sizes are taken as
    8192 (large, as a dynamic batch or sequence usually is)."""
    expr = sympy.sympify(expr)
    if not expr.is_Integer:
        expr = expr.xreplace({s: sympy.Integer(8192) for s in expr.free_symbols})
    return int(expr)


def as_number(expr: Expr, hints: dict | None = None) -> float | None:
    """A size expression as a number (symbolic sizes at their hints), or None if unknown."""
    expr = sympy.sympify(expr)
    if hints:
        expr = expr.xreplace(hints)
    return float(expr) if expr.is_number else None


# -- estimates --------------------------------------------------------------------------------


def estimate_seconds(cost: KernelCost, target: Target, hints: dict | None = None) -> float | None:
    """The roofline estimate on `target`: max(bytes / bandwidth, FLOPs / FLOP rate) plus a launch;
    None where a size is unknown or the target's limits were not measured."""
    moved, flops = as_number(cost.bytes, hints), as_number(cost.flops, hints)
    if moved is None or flops is None or not target.bandwidth or not target.flop_rate:
        return None
    return max(moved / target.bandwidth, flops / target.flop_rate) + target.launch_seconds


def bound(cost: KernelCost, target: Target) -> str:
    """Which limit the estimate meets first: "memory", "compute", or "" where it cannot tell."""
    moved, flops = as_number(cost.bytes), as_number(cost.flops)
    if moved is None or flops is None or not target.bandwidth or not target.flop_rate:
        return ""
    return "memory" if moved / target.bandwidth >= flops / target.flop_rate else "compute"
