"""Building a kernel (kernel.py's IR) from a group of graph values.

Building is also how the scheduler checks that a fusion is legal: a group whose reduction
result would be read at an index other than its own row cannot be built, and raises
`NotFusable`.

Views are never materialized here: reading a view at an index reads its base at the view's
index map. Pointwise values that are not realized are recomputed at each index they are
read (inlining); CSE keeps the DAG linear in size. After building, adjacent loop dims that
every index walks contiguously are merged (`merge_dims`).
"""

from __future__ import annotations

import functools
import sys

import sympy
import torch

from ember.ir import dtypes, ops
from ember.ir.graph import Value, layout_of
from ember.ir.sizes import Expr, affine_split, index_symbol, product
from ember.ir.views import VIEW_KINDS, broadcast_index, simplify_index
from ember.schedule.kernel import (
    COLUMN_PARTIAL_KINDS,
    Domain,
    Gather,
    IndexedStore,
    KColumnPartial,
    KConst,
    KConvert,
    Kernel,
    KIndex,
    KLoad,
    KNode,
    KOp,
    KReduce,
    KRow,
    KStore,
    NotFusable,
    subtree,
    walk,
)


def _small_integer_power(operands: list, dtype: torch.dtype) -> bool:
    base, exponent = operands
    return (
        dtype.is_floating_point
        and base.dtype == dtype
        and isinstance(exponent, KConst)
        and not isinstance(exponent.value, bool)
        and exponent.value in (1, 2, 3, 4)
    )


_EXACT_WIDENINGS = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}


def _widens(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """Every `narrow` value is exactly a `wide` value, so narrow -> wide -> narrow changes nothing."""
    return (narrow, wide) in _EXACT_WIDENINGS


@functools.lru_cache(maxsize=4096)
def _round_to(value: float, dtype: torch.dtype) -> float:
    """A Python float rounded to dtype, as a conversion at run time would round it."""
    return value if dtype == torch.float64 else float(torch.tensor(value, dtype=dtype).item())


class KernelBuilder:
    """Expands a group's values into a Kernel.

    owner:   realized Value -> id of the group that computes it (loads come from its buffer)
    indexed: values stored at rows an index names (schedule/indexed_store.py) -> how
    gathers: values read at positions an index holds (schedule/gathers.py) -> how
    """

    def __init__(
        self,
        domain: Domain,
        group_id: int,
        owner: dict[Value, int],
        indexed: dict[Value, IndexedStore] | None = None,
        gathers: dict[Value, Gather] | None = None,
    ):
        self.domain = domain
        self.group_id = group_id
        self.owner = owner
        self.indexed = indexed or {}
        self.gathers = gathers or {}
        self.row_symbols = 0  # KRow symbols named so far
        self.ranges = dict(zip(domain.vars(), domain.shape))
        self.reduce_vars = {domain.vars()[d] for d in domain.reduce_dims}
        self.cse: dict[tuple, KNode] = {}
        self.memo: dict[tuple, KNode] = {}
        self.reduces: list[KReduce] = []
        self.reads: dict[Value, None] = {}
        self.origins: dict[str, None] = {}
        self.fx_nodes: dict[str, None] = {}  # the ATen FX nodes they were
        self.column_partials: list[KColumnPartial] = []
        self.rows_by_symbol: dict[sympy.Symbol, KRow] = {}

    def record_origin(self, node) -> None:
        """Note the ATen op (and its FX node) an IR node of this kernel came from."""
        self.origins.setdefault(node.origin, None)
        self.fx_nodes.setdefault(node.fx_node, None)

    # Interning: identical expressions are one node.
    def _intern(self, key: tuple, make) -> KNode:
        node = self.cse.get(key)
        if node is None:
            node = self.cse[key] = make()
        return node

    def const(self, value, dtype) -> KNode:
        if isinstance(value, Expr):
            if value.is_Integer:
                value = int(value)
            else:
                node = self._intern(("index", value), lambda: KIndex(torch.int64, False, 0, value))
                return self.convert(node, dtype)
        if dtype == torch.bool:
            value = bool(value)
        elif dtype.is_floating_point:
            value = _round_to(float(value), dtype)
        else:
            value = int(value)
        return self._intern(("const", value, dtype), lambda: KConst(dtype, False, 0, value))

    def position(self, expr: Expr) -> KNode:
        """An integer computed from the loop position (an iota), full if it varies along reduce dims."""
        expr = sympy.expand(sympy.sympify(expr))
        rows = self._rows_in(expr)
        full = bool(expr.free_symbols & self.reduce_vars) or any(r.full for r in rows)
        ready = max((r.ready for r in rows), default=0)
        return self._intern(("index", expr), lambda: KIndex(torch.int64, full, ready, expr, rows))

    def _rows_in(self, expr: Expr) -> tuple[KRow, ...]:
        """The gathered rows whose symbols an index expression uses (defined before it is computed)."""
        return tuple(r for r in self.rows_by_symbol.values() if r.symbol in expr.free_symbols)

    def convert(self, node: KNode, dtype: torch.dtype) -> KNode:
        if node.dtype == dtype:
            return node
        if isinstance(node, KConst):
            return self.const(node.value, dtype)
        if isinstance(node, KConvert) and node.arg.dtype == dtype and _widens(dtype, node.dtype):
            return node.arg  # a value widened exactly and narrowed back is itself (a bf16 load in fp32)
        return self._intern(("convert", id(node), dtype), lambda: KConvert(dtype, node.full, node.ready, node))

    def op(self, fn: str, operands: list[KNode], dtype: torch.dtype) -> KNode:
        if fn == "pow" and _small_integer_power(operands, dtype):
            # x ** 2, 3, 4 as products (tanh-gelu's x ** 3): libdevice's pow goes through log and
            # exp and made the H100's gelu kernel compute-bound (95 us where 38 us moves its bytes).
            x, times = operands[0], int(operands[1].value)
            result = x
            for _ in range(times - 1):
                result = self.op("mul", [result, x], dtype)
            return result
        if fn == "mul" and len(operands) == 2:  # x * 1 is x, exactly (batch norm's momentum-free forms)
            for one, other in (operands, operands[::-1]):
                is_one = isinstance(one, KConst) and one.value == 1 and not isinstance(one.value, bool)
                if is_one and other.dtype == dtype:
                    return other
        key = ("op", fn, tuple(id(o) for o in operands))
        full = any(o.full for o in operands)
        ready = max((o.ready for o in operands), default=0)
        return self._intern(key, lambda: KOp(dtype, full, ready, fn, tuple(operands)))

    def load(self, value: Value, index: list[Expr]) -> KNode:
        offset = sum((i * s for i, s in zip(index, layout_of(value))), sympy.Integer(0))
        rows = self._rows_in(offset)
        # A loop of extent 1 is at 0: a load indexed by it does not vary along it (a split's
        # [S, N/S] chunks with S = N read each chunk's first row once, not once per step).
        ones = {v: 0 for v in offset.free_symbols if self.ranges.get(v) == 1}
        offset = simplify_index(sympy.expand(offset.subs(ones) if ones else offset), self.ranges)
        self.reads.setdefault(value, None)
        full = bool(offset.free_symbols & self.reduce_vars) or any(r.full for r in rows)
        ready = max((r.ready for r in rows), default=0)
        raw = self._intern(("load", value.id, offset), lambda: KLoad(value.dtype, full, ready, value, offset, rows))
        return self.convert(raw, dtypes.compute_dtype(value.dtype))

    def row(self, position: KNode, size: Expr, wrap: bool, origin: str) -> KRow:
        """The position `position` names along a dim of `size` (kernel.KRow), one per distinct
        position: two gathers by one index share it."""

        def make() -> KRow:
            symbol = index_symbol(f"row{self.row_symbols}")
            self.row_symbols += 1
            row = KRow(torch.int64, position.full, position.ready, symbol, position, sympy.sympify(size), wrap, origin)
            self.rows_by_symbol[symbol] = row
            return row

        return self._intern(("row", id(position), sympy.sympify(size), wrap), make)

    def gather(self, gather: Gather, index: list[Expr]) -> KNode:
        """`gather.value` at `index`: its source read at the rows the index tensors hold there."""
        dim, src = gather.dim, gather.src
        shape = gather.rows
        at = index if gather.per_element else index[dim : dim + len(shape)]
        rows = []
        for k, idx in enumerate((gather.index, *gather.more)):
            where = broadcast_index(at, idx.shape, shape)
            position = self.convert(self.expr(idx, where), torch.int64)
            rows.append(self.row(position, src.shape[dim + k], gather.wrap, gather.value.node.origin))
        self.record_origin(gather.value.node)  # its result is the source's load: expr() does not note it
        if gather.per_element:
            at = [rows[0].symbol if d == dim else i for d, i in enumerate(index)]
        else:
            at = [*index[:dim], *(r.symbol for r in rows), *index[dim + len(shape) :]]
        result = self.expr(src, at)
        walked = _walked(result)
        for row in rows:
            if row.symbol not in walked:
                # The source does not vary along the gathered dim (a broadcast, a constant): the row is
                # still checked, as eager checks it, through a select that keeps the value either way.
                inside = self.op("ge", [row, self.const(0, torch.int64)], torch.bool)
                result = self.op("where", [inside, result, result], result.dtype)
        return result

    # The core: the expression for `value` at `index` (a list of index expressions).
    def expr(self, value: Value, index: list[Expr]) -> KNode:
        key = (value.id, tuple(index))
        cached = self.memo.get(key)
        if cached is None:
            cached = self.memo[key] = self._expr(value, index)
            if not isinstance(cached, (KLoad, KConvert)) or value.node.op == "cast":
                self.record_origin(value.node)  # post-order: producers first
        return cached

    def _expr(self, value: Value, index: list[Expr]) -> KNode:
        node = value.node
        owner = self.owner.get(value)
        if value in self.indexed and owner == self.group_id:
            raise NotFusable(f"%{value.name} is read in the kernel that scatters its rows")
        if value in self.gathers and (owner is None or owner == self.group_id):
            return self.gather(self.gathers[value], index)
        if node.op in ("input", "extern") or (owner is not None and owner != self.group_id):
            return self.load(value, index)
        if node.op == "view":
            (base,) = node.inputs
            kind = VIEW_KINDS[node.attrs["kind"]]
            return self.expr(base, kind.index(list(index), base.shape, value.shape, node.attrs))
        if node.op == "reduce":
            return self._reduce_ref(value, index)
        if node.op == "full":
            return self.const(node.attrs["value"], dtypes.compute_dtype(value.dtype))
        if node.op == "iota":
            return self.convert(self.position(node.attrs["start"] + node.attrs["step"] * index[0]), value.dtype)
        if node.op == "cast":
            (x,) = node.inputs
            # x is held in its compute dtype (bf16 math in fp32): round to x's own dtype first, as
            # eager's x is, or a bf16 -> f32 cast would see more bits than the stored bf16 value.
            arg = self.convert(self.expr(x, broadcast_index(index, x.shape, value.shape)), x.dtype)
            rounded = self.convert(arg, value.dtype)
            return self.convert(rounded, dtypes.compute_dtype(value.dtype))
        if node.op == "pointwise":
            return self._pointwise(value, index)
        raise NotFusable(f"cannot generate {node.op}")

    def _pointwise(self, value: Value, index: list[Expr]) -> KNode:
        node = value.node
        spec = ops.POINTWISE[node.attrs["fn"]]
        out_dtype = dtypes.compute_dtype(value.dtype)
        if spec.kind == "compare":
            promoted = [node.attrs["operand_dtype"]] * spec.arity
        elif spec.kind == "select":
            promoted = [torch.bool, value.dtype, value.dtype]
        else:
            promoted = [value.dtype] * spec.arity
        operands = []
        for x, to in zip(node.inputs, promoted):
            dt = dtypes.compute_dtype(to)
            if isinstance(x, Value):
                arg = self.expr(x, broadcast_index(index, x.shape, value.shape))
                if to != x.dtype and x.dtype != dtypes.compute_dtype(x.dtype):
                    # Type promotion widens x (a bf16 value in a float32 op): eager widens the rounded
                    # value, as an explicit cast does (_expr "cast"); both reads must see one value
                    # (var over one element: x - mean(x) was 2^-9, not 0, and 0/0 became inf).
                    arg = self.convert(arg, x.dtype)
                operands.append(self.convert(arg, dt))
            else:
                operands.append(self.const(x, dt))
        return self.op(spec.name, operands, out_dtype)

    def _reduce_ref(self, value: Value, index: list[Expr]) -> KNode:
        """A reduction computed in this kernel may be read only at its own row."""
        row = self.domain.index_for(value.shape) if self.domain.reduce_dims else None
        if row is None or [sympy.expand(i) for i in index] != row:
            raise NotFusable(f"%{value.name} is read at {index}, not at its row")
        return self.reduction(value)

    def reduction(self, value: Value) -> KReduce:
        key = ("reduce", value.id)
        if key in self.cse:
            return self.cse[key]
        node = value.node
        (x,) = node.inputs
        if x.shape != self.domain.shape or tuple(node.attrs["dims"]) != self.domain.reduce_dims:
            raise NotFusable(f"reduction %{value.name} has another domain than {self.domain}")
        acc = dtypes.compute_dtype(value.dtype)
        arg = self.convert(self.expr(x, self.domain.vars()), acc)
        phase = arg.ready
        red = KReduce(acc, False, phase + 1, node.attrs["kind"], arg, phase)
        self.record_origin(node)
        self.cse[key] = red
        self.reduces.append(red)
        return red

    def column_partial(self, value: Value, x: Value) -> None:
        """Accumulate `value`, a chunked column reduction of `x` (`column_partial_input`), over the rows."""
        acc = dtypes.compute_dtype(value.dtype)
        arg = self.convert(self.expr(x, self.domain.vars()), acc)
        v = self.domain.vars()
        row = _row_major([(v[d], self.domain.shape[d]) for d in self.domain.outer_dims])
        strides = layout_of(value)
        column = sum((v[d] * st for d, st in zip(self.domain.reduce_dims, strides[1:])), sympy.Integer(0))
        rows = int(value.node.inputs[0].shape[1])
        self.column_partials.append(
            KColumnPartial(value, value.node.attrs["kind"], arg, rows, row, sympy.expand(column), strides[0])
        )
        self.record_origin(value.node)

    def store(self, value: Value) -> KStore:
        if value in self.indexed:
            return self.indexed_store(self.indexed[value])
        index = self.domain.index_for(value.shape)
        if index is None:
            raise NotFusable(f"%{value.name} {value.type_str} does not fit domain {self.domain}")
        node = value.node
        if node.op == "reduce":
            result: KNode = self.reduction(value)
        else:
            result = self.expr(value, index)
        stored = self.convert(result, value.dtype)
        offset = sympy.expand(sum((i * s for i, s in zip(index, layout_of(value))), sympy.Integer(0)))
        # A value constant along the reduce dims (a broadcast row value) stored at an offset that
        # walks them is still written once per element: the store belongs inside the row loop.
        full = result.full or bool(offset.free_symbols & self.reduce_vars)
        return KStore(value, offset, stored, result.ready, full)

    def indexed_store(self, store: IndexedStore) -> KStore:
        """The rows `store.src` stored into (or, where `store.accumulate`, added to) `store.new` at the
        positions `store.index` holds along `store.dim` (an indexed_store.IndexedStore)."""
        index = self.domain.index_for(store.rows)
        if index is None:
            raise NotFusable(f"rows {store.rows} of %{store.new.name} do not fit domain {self.domain}")
        src = self.expr(store.src, broadcast_index(index, store.src.shape, store.rows))
        value = self.convert(src, store.new.dtype)
        at_index = index if store.per_element else [index[store.dim]]
        position = self.convert(self.expr(store.index, at_index), torch.int64)
        row = self.row(position, store.dst.shape[store.dim], store.wrap, store.new.node.origin)
        at = [row.symbol if d == store.dim else i for d, i in enumerate(index)]
        offset = sympy.expand(sum((i * s for i, s in zip(at, layout_of(store.new))), sympy.Integer(0)))
        full = value.full or row.full or bool(offset.free_symbols & self.reduce_vars)
        self.record_origin(store.new.node)
        if store.initial is not None:
            if self.owner.get(store.initial) == self.group_id:
                # The host copies it into the buffer before the launch: it must be computed before.
                raise NotFusable(f"the initial value of %{store.new.name} in the kernel adding into it")
            self.reads.setdefault(store.initial, None)  # copied into the buffer before the kernel runs
        ready = max(value.ready, row.ready)
        return KStore(store.new, offset, value, ready, full, row, store.accumulate, store.initial)


def column_partial_input(value: Value, domain: Domain) -> Value | None:
    """The [rows..., row] value whose chunks `value` reduces, if `value` is the first stage of a
    split column reduction over `domain`'s rows: `domain` reduces its trailing dims (a row kernel),
    and `value` reduces dim 1 of that value reshaped to [S, rows / S, row...] (split.py's form)."""
    node = value.node
    if node.op != "reduce" or node.attrs["kind"] not in COLUMN_PARTIAL_KINDS or tuple(node.attrs["dims"]) != (1,):
        return None
    outer = len(domain.outer_dims)
    if not domain.reduce_dims or outer == 0 or domain.reduce_dims != tuple(range(outer, len(domain.shape))):
        return None
    (chunks,) = node.inputs
    if chunks.node.op != "view" or chunks.node.attrs["kind"] != "reshape":
        return None
    (x,) = chunks.node.inputs
    row = tuple(domain.shape[outer:])
    if tuple(x.shape) != tuple(domain.shape) or tuple(chunks.shape[2:]) != row or len(chunks.shape) != 2 + len(row):
        return None
    if not chunks.shape[1].is_Integer or sympy.expand(product(chunks.shape[:2]) - product(domain.outer_shape)) != 0:
        return None
    rows = int(chunks.shape[1])
    if rows & (rows - 1):
        return None  # a program walks its chunk in power-of-two row blocks, which must tile it
    return x


# Python frames the expression walk takes per value it passes (expr -> _expr -> _pointwise).
_FRAMES_PER_VALUE = 3


def room_for_depth(values: int) -> None:
    """Let the expression walk, which recurses once per value along a chain of fused producers,
    go as deep as a kernel's chain can be: a hundred pointwise steps in a row took ~300 frames
    and, with the caller's frames, passed Python's default limit of 1000. The limit is only ever
    raised (compiles on other threads may be walking too); Python's own frames on 3.11+ cost no
    C stack, so a higher limit is safe."""
    needed = 1000 + _FRAMES_PER_VALUE * values
    if needed > sys.getrecursionlimit():
        sys.setrecursionlimit(needed)


def build_kernel(
    name: str,
    domain: Domain,
    group_id: int,
    roots: list[Value],
    stored: list[Value],
    owner,
    column_partials: bool = False,
    indexed: dict[Value, IndexedStore] | None = None,
    gathers: dict[Value, Gather] | None = None,
) -> Kernel:
    """Build the kernel computing `roots` (reductions included) and storing `stored`.
    `column_partials`: the target renders KColumnPartial, so roots that are chunked column sums
    over this domain's rows are accumulated by the row loop. `indexed`: values stored at rows an
    index names (schedule/indexed_store.py; realize.py keeps them among the values always stored).
    `gathers`: values read at the positions an index holds (schedule/gathers.py)."""
    b = KernelBuilder(domain, group_id, owner, indexed, gathers)
    summed = {v: column_partial_input(v, domain) for v in roots} if column_partials else {}
    partial = {v: x for v, x in summed.items() if x is not None}
    stores = [b.store(v) for v in stored if v not in partial]
    for v, x in partial.items():
        if v in stored:
            b.column_partial(v, x)
    for v in roots:
        if v in partial:
            continue
        if v.node.op == "reduce":
            b.reduction(v)
        elif v not in stored:
            index = domain.index_for(v.shape)  # () for a 0-d domain: falsy but fitting
            b.expr(v, index if index is not None else _no_fit(v, domain))
    num_phases = max([r.phase + 1 for r in b.reduces] + [s.phase + 1 for s in stores if s.full] + [1])
    kernel = Kernel(
        name=name,
        domain=domain,
        stores=stores,
        reduces=b.reduces,
        reads=list(b.reads),
        origins=list(b.origins),
        fx_nodes=[n for n in b.fx_nodes if n],
        num_phases=num_phases,
        column_partials=b.column_partials,
    )
    merge_dims(kernel)
    if kernel.column_partials:
        if len({c.rows for c in kernel.column_partials}) > 1:
            raise NotFusable("column sums over chunks of different sizes")
        # The target gives each program one chunk of rows by its flat row index: the outer loop
        # dims must still walk the rows in row-major order after merging.
        loop = zip(kernel.index_vars, kernel.loop_sizes, kernel.loop_reduce)
        flat = _row_major([(v, size) for v, size, r in loop if not r])
        if sympy.expand(kernel.index(kernel.column_partials[0].row) - flat) != 0:
            raise NotFusable("column sums: the row loop does not walk rows in order")
    return kernel


def _row_major(dims: list[tuple[Expr, Expr]]) -> Expr:
    """The flat index of (variable, size) dims, the last one contiguous."""
    flat, inner = sympy.Integer(0), sympy.Integer(1)
    for v, size in reversed(dims):
        flat, inner = flat + v * inner, inner * size
    return flat


def _no_fit(v, domain):
    raise NotFusable(f"%{v.name} does not fit domain {domain}")


def merge_dims(kernel: Kernel) -> None:
    """Collapse adjacent loop dims that every index expression walks contiguously.

    A row-major [N, C] pointwise kernel becomes one loop over N*C; a bias add over [N, C]
    stays two loops. Fewer dims mean less index arithmetic (div/mod in Triton, loop nests in
    C++). Dims of size 1 vanish.
    """
    dom = kernel.domain
    dims = [(v, s, d in dom.reduce_dims) for d, (v, s) in enumerate(zip(dom.vars(), dom.shape))]
    exprs = {s.index for s in kernel.stores} | {n.index for n in walk(kernel) if isinstance(n, KLoad)}
    exprs |= {n.expr for n in walk(kernel) if isinstance(n, KIndex) and n.expr.free_symbols & set(dom.vars())}
    exprs |= {e for c in kernel.column_partials for e in (c.row, c.column)}
    current = {e: e for e in exprs}
    # Drop size-1 dims.
    for v, s, _ in dims:
        if s == 1:
            current = {k: e.subs(v, 0) for k, e in current.items()}
    dims = [d for d in dims if d[1] != 1]
    # Outer dims first, then reduce dims, each in memory order; merge neighbours within a class.
    merged: list[tuple] = []
    for cls in (False, True):
        group = _memory_order(kernel, [d for d in dims if d[2] == cls])
        k = 0
        while k < len(group):
            v, s, _ = group[k]
            while k + 1 < len(group):
                v2, s2, _ = group[k + 1]
                new = _try_merge(current, v, v2, s2)
                if new is None:
                    break
                current, s = new, s * s2  # v now names the merged dim
                k += 1
            merged.append((v, s, cls))
            k += 1
    names = {}
    for idx, (v, s, cls) in enumerate(merged):
        names[v] = index_symbol(f"l{idx}")
    kernel.rewritten = {k: sympy.expand(e.xreplace(names)) for k, e in current.items()}
    kernel.index_vars = [names[v] for v, _, _ in merged]
    kernel.loop_sizes = [s for _, s, _ in merged]
    kernel.loop_reduce = [cls for _, _, cls in merged]


def _memory_order(kernel: Kernel, group: list[tuple]) -> list[tuple]:
    """The dims of one class (outer or reduce) ordered outermost-first by their stride in the
    biggest buffer the kernel walks with them (a store preferred: its writes), so that the
    innermost loop, which GPU threads and SIMD lanes share, walks memory contiguously. A
    channels-last [N, C, H, W] tensor is walked N, H, W, C, not N, C, H, W with stride C."""
    if len(group) < 2:
        return group
    vars_ = {v for v, _, _ in group}
    # A store at indexed rows (KRow) says nothing of the order along the rows' dim: it is not a reference.
    candidates = [(1, _bytes_for_ranking(s.buffer), s.index) for s in kernel.stores if s.row is None]
    candidates += [(0, _bytes_for_ranking(n.buffer), n.index) for n in walk(kernel) if isinstance(n, KLoad)]
    candidates = [c for c in candidates if c[2].free_symbols & vars_]
    if not candidates:
        return group
    _, _, ref = max(candidates, key=lambda c: (c[0], c[1]))
    # A gathered row (KRow) jumps across its buffer as the dims its position depends on advance:
    # those dims go outside the ones the load walks contiguously (a graph network's [edges, features]
    # messages are read a feature row at a time, not a column of scattered rows).
    jumps = {v for r in walk(kernel) if isinstance(r, KRow) and r.symbol in ref.free_symbols for v in _walked(r)}
    strides = {}
    for v, _, _ in group:
        split = affine_split(sympy.expand(ref), v)
        if split is None or not sympy.sympify(split[0]).is_Integer:
            return group  # not affine, or a symbolic stride: keep the logical order
        strides[v] = abs(int(split[0])) or (sys.maxsize if v in jumps else 0)
    return sorted(group, key=lambda d: -strides[d[0]])  # stable: equal strides keep their order


def _walked(node: KNode) -> set:
    """The domain variables the loads and positions under `node` depend on."""
    found: set = set()
    for n in subtree(node):
        if isinstance(n, KLoad):
            found |= n.index.free_symbols
        elif isinstance(n, KIndex):
            found |= n.expr.free_symbols
    return found


def _bytes_for_ranking(v: Value) -> int:
    """Bytes of a buffer, only to pick the biggest one: a symbolic size ranks above any static one."""
    numel = sympy.sympify(product(v.shape))
    return (int(numel) if numel.is_Integer else 1 << 30) * v.dtype.itemsize


def _try_merge(current: dict, outer, inner, inner_size) -> dict | None:
    """Rewrite c*outer + c_in*inner as c_in*(outer*inner_size + inner) if c == c_in*inner_size everywhere."""
    out = {}
    for k, e in current.items():
        a = affine_split(e, outer)
        if a is None:
            return None
        c_outer, rest = a
        b = affine_split(rest, inner)
        if b is None:
            return None
        c_inner, rest2 = b
        if sympy.expand(c_outer - c_inner * inner_size) != 0:
            return None
        out[k] = rest2 + c_inner * outer  # `outer` now names the merged var
    return out
