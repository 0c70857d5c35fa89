"""What every kernel renderer shares: emission order over phases, naming, index printing.

A kernel is emitted as:

    for each row (outer loop dims; spread over threads / programs):
        row-level values ready at phase 0, row-level stores
        phase 0: loop over reduce dims: full values, reduction updates, full stores
        finalize phase-0 reductions; row-level values that needed them; ...
        phase 1: ...

A language subclass renders single nodes and loop scaffolding. With `persistent=True` (Triton
holding a whole row in registers) phases share one scope, so values computed in an early
phase are reused, not recomputed, in later ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ember.ir.sizes import IndexDiv, IndexMod
from ember.schedule.kernel import KConst, Kernel, KIndex, KLoad, KNode, KReduce, KRow, KStore, walk


@dataclass
class Param:
    name: str
    kind: str  # "buffer" | "size"
    value: object  # the ember Value for buffers, the sympy symbol/expr for sizes
    written: bool = False


def combo_params(reads: list, writes: list) -> list[Param]:
    """The parameters of a combo kernel (schedule/kernel.py: ComboKernel), from its reads and
    writes: named and ordered as Renderer names a kernel's buffers, so each part's names are the
    combo kernel's and the host program passes the buffers in the same order."""
    seen: dict[int, Param] = {}
    for v in reads:
        seen.setdefault(v.id, Param(f"in_{v.name}", "buffer", v))
    for v in writes:
        if v.id in seen:
            seen[v.id].written = True
        else:
            seen[v.id] = Param(f"out_{v.name}", "buffer", v, written=True)
    return list(seen.values())


def print_host_index(expr) -> str:
    """Print an integer size expression as Python, for a host program (its launch arguments too)."""
    return print_index(expr, "//", host=True)


def print_index(expr, floordiv: str, host: bool = False) -> str:
    """Print an integer index expression; floordiv is '//' (Triton, or Python where `host`) or '/' (C++)."""
    # Numbers and symbols, most of what is printed (every static size and stride), expand to
    # themselves: printed without a call into sympy's expand.
    if isinstance(expr, sympy.Integer):
        return str(int(expr))
    if isinstance(expr, sympy.Symbol):
        return expr.name
    expr = sympy.expand(expr) if not isinstance(expr, (IndexDiv, IndexMod)) else expr
    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Symbol:
        return expr.name
    if isinstance(expr, IndexDiv):
        return f"({print_index(expr.args[0], floordiv, host)} {floordiv} {print_index(expr.args[1], floordiv, host)})"
    if isinstance(expr, IndexMod):
        return f"({print_index(expr.args[0], floordiv, host)} % {print_index(expr.args[1], floordiv, host)})"
    if expr.is_Add:
        terms = sorted(expr.args, key=sympy.default_sort_key)
        return "(" + " + ".join(print_index(t, floordiv, host) for t in terms) + ")"
    if expr.is_Mul:
        return "(" + " * ".join(print_index(f, floordiv, host) for f in expr.args) + ")"
    if isinstance(expr, (sympy.Min, sympy.Max)):  # replicate_pad's clamps, nested pairwise
        fn = {("//", sympy.Min): "tl.minimum", ("//", sympy.Max): "tl.maximum"}.get((floordiv, type(expr)))
        if host:  # Python's own (a stride over a data-dependent size: max(1, u0))
            fn = "min" if isinstance(expr, sympy.Min) else "max"
        # C++: by-value ternaries (codegen/cpp.py's prelude). std::min returns a reference, which GCC 12
        # keeps as a branch inside a loop, and a branch leaves that loop unvectorized.
        fn = fn or ("ember_min_index" if isinstance(expr, sympy.Min) else "ember_max_index")
        first, *rest = expr.args
        out = print_index(first, floordiv, host)
        for a in rest:
            out = f"{fn}({out}, {print_index(a, floordiv, host)})"
        return out
    if expr.is_Pow and expr.exp.is_Integer and expr.exp > 0:
        return "(" + " * ".join([print_index(expr.base, floordiv, host)] * int(expr.exp)) + ")"
    raise NotImplementedError(f"index expression {expr}")


class Renderer:
    """Walks a kernel in emission order; subclasses render the pieces."""

    persistent = False

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.lines: list[str] = []
        self.indent = 0
        self.names: dict[int, str] = {}
        self.counter = 0
        self.nodes = walk(kernel)
        self.params = self._params()

    # -- parameters -----------------------------------------------------------------------
    def _params(self) -> list[Param]:
        params: list[Param] = []
        seen: dict[int, Param] = {}
        for v in self.kernel.reads:
            seen[v.id] = Param(f"in_{v.name}", "buffer", v)
            params.append(seen[v.id])
        for v in self.kernel.writes:
            if v.id in seen:
                seen[v.id].written = True
            else:
                seen[v.id] = Param(f"out_{v.name}", "buffer", v, written=True)
                params.append(seen[v.id])
        for sym in self.kernel.size_symbols():
            params.append(Param(sym.name, "size", sym))
        return params

    def buffer_name(self, value) -> str:
        return next(p.name for p in self.params if p.kind == "buffer" and p.value is value)

    # -- emission -------------------------------------------------------------------------
    def emit(self, line: str = "") -> None:
        self.lines.append("    " * self.indent + line if line else "")

    def fresh(self, prefix: str = "tmp") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def ref(self, node: KNode) -> str:
        if isinstance(node, KConst):
            return self.const(node)
        return self.names[id(node)]

    def emit_node(self, node: KNode) -> None:
        """Emit node (and any operands not yet emitted in this scope)."""
        if id(node) in self.names or isinstance(node, KConst):
            return
        for a in node.args():
            self.emit_node(a)
        if isinstance(node, KReduce):
            raise TypeError("reductions are finalized by their phase, not emitted on demand")
        # A row read from an index tensor is named by its symbol: index expressions hold that name.
        name = node.symbol.name if isinstance(node, KRow) else self.fresh()
        self.names[id(node)] = name
        self.define(name, node)

    def body(self) -> None:
        """The per-row part of the kernel (inside the outer loops / program)."""
        k = self.kernel
        row_nodes = [n for n in self.nodes if not n.full and not isinstance(n, KReduce)]
        for phase in range(k.num_phases + 1):
            for n in row_nodes:
                if n.ready == phase:
                    self.emit_node(n)
            for s in k.stores:
                if not s.full and s.phase == phase:
                    self.emit_store(s)
            if phase == k.num_phases:
                break
            # An online sum reads its max partner's accumulator before the partner updates it.
            phase_reduces = [r for r in k.reduces if r.phase == phase]
            direct = [r for r in phase_reduces if self.direct_reduce(r)]
            reduces = sorted((r for r in phase_reduces if r not in direct), key=lambda r: r.online_max is None)
            full_stores = [s for s in k.stores if s.full and s.phase == phase]
            for r in direct:
                name = self.fresh("red")
                self.reduce_direct(name, r)
                self.names[id(r)] = name
            if not reduces and not full_stores:
                continue
            accs = self.accs = {id(r): self.fresh("acc") for r in reduces}
            for r in reduces:
                self.reduce_init(accs[id(r)], r)
            saved = dict(self.names)
            self.open_phase(phase)
            for r in reduces:
                self.emit_node(r.arg)
                self.reduce_update(accs[id(r)], r)
            for s in full_stores:
                self.emit_node(s.value)
                self.emit_store(s)
            self.close_phase()
            if not self.persistent:
                self.names = saved
            for r in reduces:
                name = self.fresh("red")
                self.names[id(r)] = name
                self.reduce_finalize(name, accs[id(r)], r)

    # -- hooks ----------------------------------------------------------------------------
    def direct_reduce(self, r: KReduce) -> bool:
        """Whether r is computed without a loop over the row (`reduce_direct`), not in its phase."""
        return False

    def reduce_direct(self, name: str, r: KReduce) -> None:
        raise NotImplementedError

    def const(self, node: KConst) -> str:
        raise NotImplementedError

    def define(self, name: str, node: KNode) -> None:
        raise NotImplementedError

    def emit_store(self, store: KStore) -> None:
        raise NotImplementedError

    def open_phase(self, phase: int) -> None:
        raise NotImplementedError

    def close_phase(self) -> None:
        raise NotImplementedError

    def reduce_init(self, acc: str, r: KReduce) -> None:
        raise NotImplementedError

    def reduce_update(self, acc: str, r: KReduce) -> None:
        raise NotImplementedError

    def reduce_finalize(self, name: str, acc: str, r: KReduce) -> None:
        raise NotImplementedError

    def index_of(self, node) -> str:
        raise NotImplementedError


def is_scalar(node: KNode) -> bool:
    """Whether a node holds one value for the whole kernel (constants and size arithmetic)."""
    if isinstance(node, KConst):
        return True
    if isinstance(node, KIndex):  # size arithmetic, not a position (loop and domain vars: l*, d*)
        return not any(s.name[0] in "ld" for s in node.expr.free_symbols) and all(is_scalar(r) for r in node.rows)
    args = node.args()
    # A load's operands are the rows it reads at (a gather): never a value for the whole kernel.
    return bool(args) and all(is_scalar(a) for a in args) and not isinstance(node, (KReduce, KLoad))


def unclamped(index, loop_vars: set, floordiv: str) -> tuple[object, list[str]]:
    """A load index without replicate_pad's clamps, and the conditions under which it is in range
    (printed with `floordiv`: "//" for Triton, "/" for C++).

    Positions outside a replicate_pad view's base are always selected away by the reader (cat,
    constant padding and max pooling put a `where` over them), so instead of clamping the index
    into the base, the load is masked there (Triton) or made conditional (C++). The index is then
    affine: Triton's axis analysis vectorizes and coalesces the load (H100, GPT-2's 8192x2304 bf16
    cat: 180 us per call with clamps where ATen's copy takes 25 us), and a C++ compiler vectorizes
    the loop with masked loads, where clamps made each element a gather."""
    if not index.has(sympy.Min, sympy.Max):
        return index, []  # no clamp to strip (nearly every load): the index as it is
    conditions: list[str] = []

    def strip(e):
        if isinstance(e, (sympy.Min, sympy.Max)) and len(e.args) == 2:
            bounds = [a for a in e.args if not (a.free_symbols & loop_vars)]
            if len(bounds) == 1:
                (other,) = [a for a in e.args if a is not bounds[0]]
                inner = strip(other)
                op = "<=" if isinstance(e, sympy.Min) else ">="
                conditions.append(f"({print_index(inner, floordiv)} {op} {print_index(bounds[0], floordiv)})")
                return inner
        if e.args and not isinstance(e, (sympy.Min, sympy.Max)):
            return e.func(*[strip(a) for a in e.args])
        return e

    return strip(index), conditions
