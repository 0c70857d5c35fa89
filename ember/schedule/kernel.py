"""The loop-level kernel IR: what one generated kernel computes, loads and stores.

A kernel iterates over a *domain*: a shape, some of whose dims are reduced. Outer dims are
spread over programs/threads; reduce dims are looped over (or held whole in registers, if
the target can). Every value the kernel computes is a small expression DAG (`KNode`s) over
loads of buffers. A value is *row-level* if it does not vary along the reduce dims
(reduction results, per-row loads) and *full* otherwise.

The records live in schedule/ (not codegen/) because building them is how the scheduler
checks that a fusion is legal (kernel_builder.py raises `NotFusable`); code generators
only read them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ember.ir.graph import Value
from ember.ir.sizes import Expr, index_symbol


class NotFusable(Exception):
    """The group cannot be one kernel (e.g. a reduction read off its own row)."""


@dataclass(frozen=True)
class Domain:
    shape: tuple[Expr, ...]
    reduce_dims: tuple[int, ...] = ()

    @property
    def outer_dims(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.shape)) if d not in self.reduce_dims)

    @property
    def outer_shape(self) -> tuple[Expr, ...]:
        return tuple(self.shape[d] for d in self.outer_dims)

    @property
    def keepdim_shape(self) -> tuple[Expr, ...]:
        return tuple(sympy.Integer(1) if d in self.reduce_dims else s for d, s in enumerate(self.shape))

    def vars(self) -> list[sympy.Symbol]:
        return list(self._vars)

    @functools.cached_property
    def _vars(self) -> tuple[sympy.Symbol, ...]:
        return tuple(index_symbol(f"d{k}") for k in range(len(self.shape)))

    @functools.cached_property
    def _fits(self) -> dict:
        return {}

    def index_for(self, shape: tuple[Expr, ...]) -> list[Expr] | None:
        """The domain index at which a value of `shape` is produced, or None if it does not fit.
        Kept per shape: fusion asks it of every candidate pair after each merge."""
        shape = tuple(shape)
        if shape not in self._fits:
            index = self._fit(shape)
            self._fits[shape] = None if index is None else tuple(index)
        fit = self._fits[shape]
        return None if fit is None else list(fit)

    def _fit(self, shape: tuple[Expr, ...]) -> list[Expr] | None:
        v = self.vars()
        if tuple(shape) == self.shape:
            return v
        if not self.reduce_dims:
            return None
        if tuple(shape) == self.outer_shape:
            return [v[d] for d in self.outer_dims]
        if tuple(shape) == self.keepdim_shape:
            return [sympy.Integer(0) if d in self.reduce_dims else v[d] for d in range(len(self.shape))]
        outer = [(v[d], self.shape[d]) for d in self.outer_dims if self.shape[d] != 1]
        if [s for s in shape if s != 1] == [s for _, s in outer]:
            # The row shape with other size-1 dims (batch norm's mean as [1, C, 1, 1] of rows [C]).
            row = iter(outer)
            return [sympy.Integer(0) if s == 1 else next(row)[0] for s in shape]
        return None

    def row_index_of(self, reduce_value: Value) -> list[Expr]:
        index = self.index_for(reduce_value.shape)
        assert index is not None
        return index

    def __str__(self) -> str:
        dims = ", ".join(f"{'r' if k in self.reduce_dims else ''}{s}" for k, s in enumerate(self.shape))
        return f"[{dims}]"


# -- kernel expression nodes --------------------------------------------------------------
# `dtype` is the dtype of the value as the kernel holds it; `full` is whether it varies along
# reduce dims; `ready` is the first phase after which it can be computed (0: at row start).


@dataclass(eq=False)
class KNode:
    dtype: torch.dtype
    full: bool
    ready: int

    def args(self) -> tuple[KNode, ...]:
        return ()


@dataclass(eq=False)
class KRow(KNode):
    """A position along one dim of a buffer, read from an index tensor: the row a gather loads
    (schedule/gathers.py) or a scatter stores (schedule/indexed_store.py). An index that uses it
    holds `symbol` where that dim's position goes; the target defines `symbol` as `position` (an
    integer the kernel computes) and checks that it lies in [0, size), after adding `size` to a
    negative one where `wrap` (index_put's and indexing's -1 is the last row; index_copy's and
    index_select's is out of range). `origin` names the op for the error."""

    symbol: sympy.Symbol
    position: KNode
    size: Expr
    wrap: bool
    origin: str

    def args(self):
        return (self.position,)


@dataclass(eq=False)
class KLoad(KNode):
    buffer: Value
    index: Expr
    rows: tuple[KRow, ...] = ()  # the gathered positions `index` uses (defined before the load)

    def args(self):
        return self.rows

    def __repr__(self):
        return f"load({self.buffer.name}[{self.index}])"


@dataclass(eq=False)
class KConst(KNode):
    value: Any


@dataclass(eq=False)
class KIndex(KNode):
    """An integer computed from sizes (a symbolic scalar in the graph) or, for an iota, from the
    domain position (then it is rewritten with the loop dims like any load index)."""

    expr: Expr
    rows: tuple = ()  # the gathered rows (KRow) whose symbols `expr` uses: a position past a cat at them

    def args(self):
        return self.rows


@dataclass(eq=False)
class KConvert(KNode):
    arg: KNode

    def args(self):
        return (self.arg,)


@dataclass(eq=False)
class KOp(KNode):
    fn: str
    operands: tuple[KNode, ...]

    def args(self):
        return self.operands


@dataclass(eq=False)
class KReduce(KNode):
    kind: str
    arg: KNode
    phase: int = 0  # the loop over reduce dims that computes it
    # kind "sumexp": sum(exp(arg - online_max)) where online_max is the max of arg over the same
    # row, computed online in the same loop (schedule/online.py).
    online_max: KReduce | None = None

    def args(self):
        return (self.arg,)


@dataclass(frozen=True)
class IndexedStore:
    """A scatter that a kernel stores (schedule/indexed_store.py): `new` is `dst` with the rows `index`
    names along `dim` set to `src` (broadcast to `rows`, the written rows' shape), or, where
    `accumulate`, with `src` added to them.

    `index` holds one position per written row (a 1-d tensor over the rows' `dim`: index_copy,
    index_put, index_add) or, where `per_element`, one per element (shaped as `rows`: scatter_add).
    Without `accumulate`, `dst` is a graph input and `new` is stored into its memory; with it, `new` is a
    buffer the host program fills with `dst` (zeroes, where `dst` is zeros: `initial` None) before the
    kernel adds into it."""

    new: Value
    dst: Value
    index: Value
    src: Value
    dim: int
    wrap: bool  # negative positions count from the end (index_put), else they are out of range
    rows: tuple[Expr, ...]
    accumulate: bool = False
    per_element: bool = False
    initial: Value | None = None


@dataclass(frozen=True)
class Gather:
    """A gather that kernels compute where they read it (schedule/gathers.py): `value` is `src` with
    dim `dim` replaced by the dims of `index`, read at the positions `index` holds (index_select,
    embedding, `x[:, idx]`), or, where `per_element`, shaped as `index`, each element read at the
    position `index` holds there along `dim` (torch.gather). `more` indexes the dims after `dim`, one
    tensor each (`x[i, j]`), all broadcast with `index` to the shape `rows`, which replaces those dims."""

    value: Value
    src: Value
    index: Value
    dim: int
    wrap: bool  # negative positions count from the end (indexing), else they are out of range
    rows: tuple  # the indices' broadcast shape (the index's own, for one)
    per_element: bool = False
    more: tuple = ()


@dataclass(eq=False)
class KStore:
    buffer: Value
    index: Expr
    value: KNode
    phase: int
    full: bool
    row: KRow | None = None  # a store at rows an index tensor names (KRow); None: at the domain position
    accumulate: bool = False  # adds into the buffer atomically (a scatter-add), else writes it
    initial: Value | None = None  # what an accumulating store's buffer holds before the kernel: None, zeros


@dataclass(eq=False)
class KColumnPartial:
    """A reduction over the kernel's rows, not its reduce dims: the first stage of a split column
    sum (schedule/split.py) computed by a row kernel that already loads its input, as Inductor's
    "mix-order" reductions are. A LayerNorm's backward reads x and the gradient once for the input
    gradient (a row reduction) and for the weight and bias gradients (column sums) together.

    Rows [s * rows, (s + 1) * rows) reduce into row s of `buffer`, at `column` (an offset over the
    reduce dims' variables) plus s * `chunk_stride`. `row` is the flat row index over the domain's
    outer variables, row-major (the same for every sum of a kernel); the target walks each chunk's
    rows in one program."""

    buffer: Value
    kind: str
    arg: KNode
    rows: int
    row: Expr
    column: Expr
    chunk_stride: Expr


# Column reductions a row kernel may accumulate (KColumnPartial): each has an identity to mask with.
COLUMN_PARTIAL_KINDS = ("sum", "max", "min")


@dataclass
class Kernel:
    """One generated kernel: its domain, what it stores, and what it reads."""

    name: str
    domain: Domain
    stores: list[KStore]
    reduces: list[KReduce]
    reads: list[Value]  # buffers loaded, in first-use order
    origins: list[str]  # ATen ops fused into it (for reports)
    num_phases: int
    fx_nodes: list[str] = field(default_factory=list)  # the ATen FX nodes of those ops (their source lines)
    index_vars: list[sympy.Symbol] = field(default_factory=list)
    # After dimension merging: the loop dims the target iterates over.
    loop_sizes: list[Expr] = field(default_factory=list)
    loop_reduce: list[bool] = field(default_factory=list)
    # Original index expression -> expression over the merged loop variables.
    rewritten: dict = field(default_factory=dict)
    column_partials: list[KColumnPartial] = field(default_factory=list)

    @property
    def writes(self) -> list[Value]:
        return [s.buffer for s in self.stores] + [c.buffer for c in self.column_partials]

    @functools.cached_property
    def checks_rows(self) -> bool:
        """Whether it reads or writes at rows an index tensor names (KRow), each checked in the kernel."""
        return any(isinstance(n, KRow) for n in walk(self))

    @property
    def writes_nothing(self) -> bool:
        """Every buffer it stores has a zero-size dim: the host allocates them and launches nothing.
        (Such a kernel's index may name a loop variable of a dim merged away as empty, which
        Triton rejects at compile time: GPU fuzz programs 1219, 1783, 1910.)"""
        return bool(self.stores) and all(any(d == 0 for d in v.shape) for v in self.writes)

    def index(self, expr: Expr) -> Expr:
        return self.rewritten.get(expr, expr)

    def size_symbols(self) -> list[sympy.Symbol]:
        exprs = list(self.loop_sizes) + list(self.rewritten.values())
        exprs += [n.expr for n in walk(self) if isinstance(n, KIndex)]
        rows = [n for n in walk(self) if isinstance(n, KRow)]
        exprs += [r.size for r in rows]
        defined = {r.symbol for r in rows}  # in the kernel
        syms: set = set()
        for e in exprs:
            syms |= {s for s in e.free_symbols if not s.name.startswith("d") and not s.name.startswith("l")}
        return sorted(syms - defined, key=lambda s: s.name)


def subtree(node: KNode) -> list[KNode]:
    """`node` and every node under it, each once."""
    seen: dict[int, KNode] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen[id(n)] = n
            stack.extend(n.args())
    return list(seen.values())


def walk(kernel: Kernel) -> list[KNode]:
    """Every KNode reachable from the kernel's stores, each once, operands before users."""
    seen: dict[int, KNode] = {}

    def visit(n: KNode):
        if id(n) in seen:
            return
        for a in n.args():
            visit(a)
        seen[id(n)] = n

    for s in kernel.stores:
        if s.row is not None:
            visit(s.row)
        visit(s.value)
    for r in kernel.reduces:
        visit(r)
    for c in kernel.column_partials:
        visit(c.arg)
    return list(seen.values())


@dataclass(frozen=True)
class ComboDomain:
    """The domains of a combo kernel's parts, for reports."""

    parts: tuple[Domain, ...]

    def __str__(self) -> str:
        return f"combo of {len(self.parts)}: " + " ".join(str(d) for d in self.parts)


# A table combo kernel's element counts and block numbers are int32s (codegen/triton_combo.py): a larger
# part keeps its own launch (schedule/horizontal.py).
TABLE_MAX_ELEMENTS = 2**31 - 1


@dataclass
class ComboKernel:
    """Independent pointwise kernels run as one launch (schedule/horizontal.py), as apex's
    multi_tensor_apply and Inductor's combo kernels do: each part keeps its own domain, loads and
    stores; the launch walks the parts' blocks one after another. No part reads what another writes,
    and the memory plan gives no part's output memory that another part reads."""

    name: str
    parts: list[Kernel]
    # The parts share one body (horizontal.table_signature): a target that can runs it once, each
    # program reading its part's buffer addresses and element count from a table.
    table: bool = False

    @property
    def domain(self) -> ComboDomain:
        return ComboDomain(tuple(p.domain for p in self.parts))

    @property
    def reads(self) -> list[Value]:
        seen: dict[int, Value] = {}
        for p in self.parts:
            for v in p.reads:
                seen.setdefault(v.id, v)
        return list(seen.values())

    @property
    def writes(self) -> list[Value]:
        return [v for p in self.parts for v in p.writes]

    @property
    def origins(self) -> list[str]:
        return [o for p in self.parts for o in p.origins]

    @property
    def fx_nodes(self) -> list[str]:
        return list(dict.fromkeys(n for p in self.parts for n in p.fx_nodes))

    @property
    def writes_nothing(self) -> bool:
        return all(p.writes_nothing for p in self.parts)


def kernel_parts(kernel: Kernel | ComboKernel) -> list[Kernel]:
    """The kernels a launch runs: a combo kernel's parts, or the kernel itself."""
    return list(kernel.parts) if isinstance(kernel, ComboKernel) else [kernel]
