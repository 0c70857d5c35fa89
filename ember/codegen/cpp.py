"""Render kernels as C++ with OpenMP: one translation unit per graph.

Outer loop dims become nested loops; the outermost ones are shared among threads with
`omp parallel for` (collapsed), the innermost of a pointwise kernel is an `omp simd` loop
over contiguous memory when dimension merging left it so. Each reduction phase is a loop
nest over the reduce dims inside the row. bfloat16 is stored as uint16_t and converted with
round-to-nearest-even; float16 uses the compiler's _Float16.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ember.codegen.cpp_cascade import CascadedSums
from ember.codegen.cpp_columns import ColumnTiles
from ember.codegen.cpp_interior import WindowInteriors
from ember.codegen.render import Renderer, print_index, unclamped
from ember.ir import dtypes, ops
from ember.ir.sizes import product
from ember.schedule.cost import row_passes
from ember.schedule.kernel import KConst, KConvert, Kernel, KIndex, KLoad, KNode, KOp, KReduce, KRow, KStore
from ember.target import CppHeuristics, Target

CPP_DTYPE = {
    torch.float32: "float",
    torch.float64: "double",
    torch.bfloat16: "uint16_t",
    torch.float16: "_Float16",
    torch.int64: "int64_t",
    torch.int32: "int32_t",
    torch.int16: "int16_t",
    torch.int8: "int8_t",
    torch.uint8: "uint8_t",
    torch.bool: "bool",
}

PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

static inline float ember_bf16_to_f32(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}
static inline uint16_t ember_f32_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // round to nearest even
    // NaN becomes eager's quiet NaN (c10::BFloat16 does the same). Tested on the float, the select
    // is one compare in a vector loop: RMSNorm's 4096 x 4096 bf16 kernel took 2.0 ms with an
    // integer test and an early return, 1.6 ms this way.
    return static_cast<uint16_t>(f != f ? 0x7fc0u : rounded);
}
// A long row's floating sum: the row is summed in blocks, and the blocks' sums are added pairwise,
// as a binary counter carries: level k holds the sum of 2^k blocks. Rounding error grows with the
// log of the block count, not with the row (eager's cascade_sum bounds it the same way); one
// accumulator over 2^28 ones stopped at 16 lanes x 2^24.
template <class T> struct ember_cascade {
    T level[64];
    uint64_t count = 0;
    inline void add(T block) {
        int k = 0;
        for (uint64_t carry = count++; carry & 1; carry >>= 1, k++) block = level[k] + block;
        level[k] = block;
    }
    inline T total() const {
        T sum = 0;
        int k = 0;
        for (uint64_t bits = count; bits; bits >>= 1, k++)
            if (bits & 1) sum = level[k] + sum;
        return sum;
    }
};
template <class T> static inline T ember_maximum(T a, T b) { return (a > b || a != a) ? a : b; }
static inline int64_t ember_min_index(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t ember_max_index(int64_t a, int64_t b) { return a > b ? a : b; }
// `where` over a condition that a vector loop does not change (a window position inside the image or
// not), as bit masks: GCC 12 turns a select on such a condition into control flow, and leaves the loop
// scalar once a few are in it (a max pool's nine window positions: 27x slower).
#if defined(__GNUC__) && !defined(__clang__)
#define EMBER_NO_PRE __attribute__((optimize("no-tree-pre")))
#else
#define EMBER_NO_PRE
#endif
template <class T> static inline T ember_pick(bool c, T a, T b) {
    using U = std::conditional_t<sizeof(T) == 8, uint64_t, std::conditional_t<sizeof(T) == 4, uint32_t,
              std::conditional_t<sizeof(T) == 2, uint16_t, uint8_t>>>;
    U x, y;
    std::memcpy(&x, &a, sizeof(T));
    std::memcpy(&y, &b, sizeof(T));
    const U m = static_cast<U>(-static_cast<U>(c));
    x = (x & m) | (y & static_cast<U>(~m));
    T r;
    std::memcpy(&r, &x, sizeof(T));
    return r;
}
template <class T> static inline T ember_minimum(T a, T b) { return (a < b || a != a) ? a : b; }
// Integer and bool max/min as OpenMP reductions, so `omp simd` vectorizes them as it does sums.
// (Floating ones use OpenMP's own max/min and a NaN flag: _FLOAT_MINMAX.) Private copies start
// from the original: max/min are idempotent.
{minmax_reductions}"""

PRELUDE = PRELUDE.replace(
    "{minmax_reductions}",
    "".join(
        f"#pragma omp declare reduction(ember_{kind} : {t} : omp_out = ember_{fn}(omp_out, omp_in)) "
        "initializer(omp_priv = omp_orig)\n"
        for t in ("int64_t", "int32_t", "int16_t", "int8_t", "uint8_t", "bool")
        for kind, fn in (("max", "maximum"), ("min", "minimum"))
    ),
)

# The `omp simd reduction` operator of each reduction kind.
_SIMD_REDUCTION = {"sum": "+", "prod": "*", "max": "ember_max", "min": "ember_min"}

_UPDATE = {
    "sum": "{acc} = {acc} + {v};",
    "prod": "{acc} = {acc} * {v};",
    "max": "{acc} = ember_maximum({acc}, {v});",
    "min": "{acc} = ember_minimum({acc}, {v});",
}

# A floating max/min keeps NaN in a flag of its own: the running value is OpenMP's plain max/min
# (a compare and a select), and `flag |= v != v` is a second chain that does not wait on it. The
# NaN-propagating select (`ember_maximum`) puts both tests in one loop-carried chain: a row max
# over 512 × 50257 bf16 took 1.48 ms that way and 0.95 ms this way on the 2-core EPYC.
_FLOAT_MINMAX = {
    "max": ("max", "{acc} = {acc} < {v} ? {v} : {acc};"),
    "min": ("min", "{acc} = {v} < {acc} ? {v} : {acc};"),
}


def _recompute_work(node: KNode, kept: dict[int, object]) -> int:
    """The work of computing a full value again: its full operands down to loads, not into row
    values (computed once per row) nor into values already kept in a row array."""
    work, seen, stack = 0, set(), [node]
    while stack:
        n = stack.pop()
        if id(n) in seen or not n.full or isinstance(n, KReduce) or (n is not node and id(n) in kept):
            continue
        seen.add(id(n))
        if isinstance(n, KLoad):
            work += 1
        elif isinstance(n, KOp):
            work += ops.POINTWISE[n.fn].flops
        elif isinstance(n, KConvert) and n.dtype in (torch.bfloat16, torch.float16):
            work += 3  # rounding: several integer ops per element
        stack.extend(n.args())
    return work


def _nan_flagged(r: KReduce) -> bool:
    return r.kind in _FLOAT_MINMAX and r.dtype.is_floating_point


def _phase_roots(kernel: Kernel, phase: int) -> list[KNode]:
    return [r.arg for r in kernel.reduces if r.phase == phase] + [
        s.value for s in kernel.stores if s.full and s.phase == phase
    ]


def _one_hot(r: KReduce, kernel: Kernel, var) -> tuple[KNode, KNode] | None:
    """(index, picked) when r is `sum_j where(j == index, picked_j, 0)` over the one reduce dim j,
    with index the same all along the row: the importer's form of gather (cross_entropy's target
    logit). None otherwise."""
    arg = r.arg
    if r.kind != "sum" or r.online_max is not None or not (isinstance(arg, KOp) and arg.fn == "where"):
        return None
    hit, picked, other = arg.operands
    if not (isinstance(other, KConst) and other.value == 0 and isinstance(hit, KOp) and hit.fn == "eq"):
        return None
    for pos, index in ((0, 1), (1, 0)):
        at, index = hit.operands[pos], hit.operands[index]
        if (
            isinstance(at, KIndex)
            and kernel.index(at.expr) == var
            and not index.full
            and not index.dtype.is_floating_point
        ):
            return index, picked
    return None


class CppRenderer(CascadedSums, WindowInteriors, ColumnTiles, Renderer):
    persistent = False

    def __init__(self, kernel: Kernel, shared: frozenset = frozenset(), heuristics: CppHeuristics | None = None):
        super().__init__(kernel)
        self.shared = shared  # buffers that share memory with another parameter: not __restrict__
        self.h = heuristics or CppHeuristics()  # the target's loop shapes (target.heuristics.cpp)
        # Rows read from an index tensor (kernel.KRow) are checked: the kernel returns whether one was out
        # of range (backends/cpp.py raises); a loop in which a row is checked carries no `omp simd` (the check
        # stores a flag).
        self.checks_rows = kernel.checks_rows
        self._varies_memo: dict[int, bool] = {}  # id(node) -> whether it changes along a vector loop

    @staticmethod
    def ctype(dtype: torch.dtype) -> str:
        return CPP_DTYPE[dtype]

    def const(self, node: KConst) -> str:
        v, dt = node.value, node.dtype
        if dt == torch.bool:
            return "true" if v else "false"
        if dt == torch.bfloat16:
            return f"ember_f32_to_bf16({self._float_literal(float(v), torch.float32)})"
        if dt.is_floating_point:
            return self._float_literal(float(v), dt)
        return f"static_cast<{CPP_DTYPE[dt]}>({int(v)}LL)"

    @staticmethod
    def _float_literal(v: float, dt: torch.dtype) -> str:
        t = CPP_DTYPE[dt] if dt != torch.bfloat16 else "float"
        if math.isnan(v):
            return f"static_cast<{t}>(NAN)"
        if math.isinf(v):
            return f"static_cast<{t}>({'' if v > 0 else '-'}INFINITY)"
        return f"static_cast<{t}>({v!r})"

    def index_of(self, expr) -> str:
        return print_index(self._index(expr), "/")

    def define(self, name: str, node: KNode) -> None:
        t = CPP_DTYPE[node.dtype]
        if isinstance(node, KLoad):
            # Only the clamps along a vector loop's variable are stripped: a clamp on the coordinates the
            # vector loop does not walk is computed once per vector loop, and the load stays plain (GCC 12
            # leaves a loop scalar where a load is conditional on a value the loop does not change: a max
            # pool's nine window loads over channels-last channels ran 27x slower that way).
            index, inside = unclamped(self._index(node.index), self._vector_vars(), "/")
            load = f"{self.buffer_name(node.buffer)}[{print_index(index, '/')}]"
            if inside:  # a replicate_pad read: loaded where in range only, its reader selects the rest away
                load = f"({' && '.join(inside)}) ? {load} : static_cast<{t}>(0)"
            self.emit(f"{t} {name} = {load};")
        elif isinstance(node, KRow):
            self._define_row(node)
        elif isinstance(node, KIndex):
            self.emit(f"{t} {name} = {self.index_of(node.expr)};")
        elif isinstance(node, KConvert):
            self.emit(f"{t} {name} = {self._convert(self.ref(node.arg), node.arg.dtype, node.dtype)};")
        elif self._picks(node):
            cond, a, b = (self.ref(x) for x in node.operands)
            self.emit(f"{t} {name} = ember_pick<{t}>({cond}, static_cast<{t}>({a}), static_cast<{t}>({b}));")
        elif isinstance(node, KOp):
            expr = ops.POINTWISE[node.fn].cpp.format(*[self.ref(a) for a in node.operands])
            self.emit(f"{t} {name} = static_cast<{t}>({expr});")
        else:
            raise NotImplementedError(type(node).__name__)

    @staticmethod
    def _convert(x: str, src: torch.dtype, dst: torch.dtype) -> str:
        if src == torch.bfloat16:
            x, src = f"ember_bf16_to_f32({x})", torch.float32
            if dst == torch.float32:
                return x
        if dst == torch.bfloat16:
            return f"ember_f32_to_bf16(static_cast<float>({x}))"
        if dst == torch.bool:
            return f"({x} != 0)"
        return f"static_cast<{CPP_DTYPE[dst]}>({x})"

    def _define_row(self, row: KRow) -> None:
        """Define the row a load or store reaches (kernel.KRow). One outside the buffer is recorded for the
        kernel's result, as eager's check raises, and replaced by row 0, so that no other memory is touched."""
        name, position, size = row.symbol.name, self.ref(row.position), print_index(row.size, "/")
        self.emit(f"int64_t {name} = static_cast<int64_t>({position});")
        if row.wrap:
            self.emit(f"if ({name} < 0) {name} += {size};")
        self.emit(f"if ({name} < 0 || {name} >= {size}) {{")
        self.emit("    __atomic_store_n(&ember_bad_row, int64_t(1), __ATOMIC_RELAXED);")
        self.emit(f"    {name} = 0;")
        self.emit("}")

    def emit_store(self, store: KStore) -> None:
        if store.row is not None:
            self.emit_node(store.row)
        if store.accumulate:
            raise NotImplementedError("the C++ target adds nothing atomically (its Target.atomic_adds is empty)")
        self.emit(f"{self.buffer_name(store.buffer)}[{self.index_of(store.index)}] = {self.ref(store.value)};")

    # -- loops -------------------------------------------------------------------------------
    def _vector_vars(self) -> set:
        """The variables of the loops that may carry `omp simd`: the innermost outer loop and the innermost
        reduce loop."""
        return {dims[-1][0] for dims in (self._dims(reduce=False), self._dims(reduce=True)) if dims}

    def _picks(self, node: KNode) -> bool:
        """Whether node is a `where` whose condition its vector loop does not change (rendered `ember_pick`)."""
        return isinstance(node, KOp) and node.fn == "where" and not self._varies(node.operands[0])

    def _varies(self, node: KNode) -> bool:
        """Whether node's value changes along a vector loop (`_vector_vars`)."""
        memo = self._varies_memo
        if id(node) not in memo:
            if isinstance(node, (KLoad, KIndex)):
                expr = self.kernel.index(node.index if isinstance(node, KLoad) else node.expr)
                own = bool(expr.free_symbols & self._vector_vars())
                memo[id(node)] = own or any(self._varies(r) for r in node.rows)
            elif isinstance(node, KReduce):
                memo[id(node)] = False  # one value a row
            else:
                memo[id(node)] = any(self._varies(a) for a in node.args())
        return memo[id(node)]

    def _dims(self, reduce: bool):
        k = self.kernel
        return [(v, s) for v, s, r in zip(k.index_vars, k.loop_sizes, k.loop_reduce) if r == reduce]

    # -- row cache ---------------------------------------------------------------------------
    def body(self) -> None:
        self._row_cache = self._plan_row_cache()
        for node, _, array in self._row_cache.values():
            self.emit(f"{CPP_DTYPE[node.dtype]} {array}[{self._row_cache_len}];")
        super().body()

    def _plan_row_cache(self) -> dict[int, tuple[KNode, int, str]]:
        """Row values that a pass computes at some cost (cpp.row_cache_min_work) and a later pass needs
        again: kept in a per-thread array of the row instead of computed twice, as Inductor's C++
        does (softmax's exp(x - max): summed, then divided; layer norm's x + r: for the mean, the
        variance and the output). One reduce dim, static rows of at most cpp.row_cache_max elements
        (on the stack). id(node) -> (node, the pass computing it, array)."""
        dims = self._dims(reduce=True)
        if len(dims) != 1 or not dims[0][1].is_Integer or int(dims[0][1]) > self.h.row_cache_max:
            return {}
        self._row_cache_len = int(dims[0][1])
        looped = replace(self.kernel, reduces=[r for r in self.kernel.reduces if not self.direct_reduce(r)])
        passes = row_passes(looped, persistent=False)
        self._pass_ids = [{id(n) for n in nodes} for nodes in passes]
        first = {}
        for p, nodes in enumerate(passes):
            for n in nodes:
                first.setdefault(id(n), p)
        reused = {id(n) for p, nodes in enumerate(passes) for n in nodes if first[id(n)] < p}
        # Candidates in pass order, so that a value's work stops at earlier kept values (layer norm's
        # x + r - mean is one subtraction once x + r is kept).
        cache: dict[int, tuple[KNode, int, str]] = {}
        for p, nodes in enumerate(passes):
            for n in nodes:
                if first[id(n)] == p and id(n) in reused and _recompute_work(n, cache) >= self.h.row_cache_min_work:
                    cache[id(n)] = (n, p, self.fresh("rowcache"))
        # Keep what a later pass reads itself, not only through another kept value (of x + r and
        # its rounding, only the outermost); and no more than cpp.row_cache_bytes of them (OpenMP
        # worker threads have small stacks).
        read = set()
        for p in range(len(passes)):
            stack = list(_phase_roots(looped, p))
            seen = set()
            while stack:
                n = stack.pop()
                if id(n) in seen or not n.full or isinstance(n, KReduce):
                    continue
                seen.add(id(n))
                if id(n) in cache and first[id(n)] < p:
                    read.add(id(n))
                    continue
                stack.extend(n.args())
        kept, used = {}, 0
        for k, (node, p, array) in cache.items():
            size = self._row_cache_len * node.dtype.itemsize
            if k in read and used + size <= self.h.row_cache_bytes:
                kept[k], used = (node, p, array), used + size
        return kept

    # -- one-hot selections ------------------------------------------------------------------
    def direct_reduce(self, r: KReduce) -> bool:
        dims = self._dims(reduce=True)
        return len(dims) == 1 and _one_hot(r, self.kernel, dims[0][0]) is not None

    def reduce_direct(self, name: str, r: KReduce) -> None:
        """The one element a one-hot sum selects, read at its index instead of compared at every
        element of the row (cross_entropy: one int64 compare and select per logit). An index
        outside the row selects nothing, as the sum does (0; the importer's bounds check raises
        after the kernel); in bounds it is the element itself, -0.0 included, as eager's gather."""
        ((var, size),) = self._dims(reduce=True)
        index, picked = _one_hot(r, self.kernel, var)
        t = CPP_DTYPE[r.dtype]
        self.emit(f"{t} {name} = {self.const(KConst(r.dtype, False, 0, 0))};")
        self.emit(f"if ({self.ref(index)} >= 0 && {self.ref(index)} < {print_index(size, '/')}) {{")
        self.indent += 1
        saved = dict(self.names)
        self.emit(f"int64_t {var.name} = static_cast<int64_t>({self.ref(index)});")
        self.emit_node(picked)
        self.emit(f"{name} = static_cast<{t}>({self.ref(picked)});")
        self.names = saved
        self.indent -= 1
        self.emit("}")

    def open_phase(self, phase: int) -> None:
        self._phase = phase
        self._open_loops(phase)
        var = self._dims(reduce=True)[0][0].name if self._row_cache else None
        for node, first, array in self._row_cache.values():
            if first < phase and id(node) in self._pass_ids[phase]:
                name = self.fresh()
                self.emit(f"{CPP_DTYPE[node.dtype]} {name} = {array}[{var}];")
                self.names[id(node)] = name

    def _open_loops(self, phase: int) -> None:
        dims = self._dims(reduce=True)
        reduces = self._phase_reduces(phase)
        # A row checked inside the loop stores a flag there: no `omp simd` (one checked per row is outside it).
        checked_inside = any(isinstance(n, KRow) and n.full for n in self.nodes)
        self._reduce_simd = len(dims) == 1 and all(r.kind in _SIMD_REDUCTION for r in reduces) and not checked_inside
        self._blocked = [r for r in reduces if self._cascaded(r)]
        if self._blocked and len(dims) > 1:
            # Several reduce loops: the innermost is cut into blocks, and a block's sum is added to
            # the cascade once the blocks since the last add hold cpp.cascade_block elements.
            self._fill = self.fresh("fill")
            self.emit(f"int64_t {self._fill} = 0;")
        for pos, (v, s) in enumerate(dims):
            start, end = "0", print_index(s, "/")
            if pos == len(dims) - 1 and self._blocked:
                block = f"{v.name}_block"
                self.emit(f"for (int64_t {block} = 0; {block} < {end}; {block} += {self._cascade_block}) {{")
                self.indent += 1
                if s.is_Integer and int(s) % self._cascade_block == 0:  # a constant trip count: no remainder loop
                    self.emit(f"const int64_t {block}_end = {block} + {self._cascade_block};")
                else:
                    self.emit(f"const int64_t {block}_end = std::min<int64_t>({block} + {self._cascade_block}, {end});")
                start, end = block, f"{block}_end"
            if pos == len(dims) - 1 and self._reduce_simd:
                by_op: dict[str, list[str]] = {}
                for r in reduces:
                    acc = self._acc_names[id(r)]
                    if _nan_flagged(r):
                        by_op.setdefault(_FLOAT_MINMAX[r.kind][0], []).append(acc)
                        by_op.setdefault("|", []).append(f"{acc}_nan")
                    else:
                        by_op.setdefault(_SIMD_REDUCTION[r.kind], []).append(acc)
                clause = "".join(f" reduction({op}:{', '.join(accs)})" for op, accs in by_op.items())
                self.emit(f"#pragma omp simd{clause}")
            self.emit(f"for (int64_t {v.name} = {start}; {v.name} < {end}; {v.name}++) {{")
            self.indent += 1
        self._open = len(dims)

    def _phase_reduces(self, phase):
        return [r for r in self.kernel.reduces if r.phase == phase and not self.direct_reduce(r)]

    def close_phase(self) -> None:
        var = self._dims(reduce=True)[0][0].name if self._row_cache else None
        for node, first, array in self._row_cache.values():
            if first == self._phase:
                self.emit(f"{array}[{var}] = {self.ref(node)};")
        for k in range(self._open):
            self.indent -= 1
            self.emit("}")
            if k == 0 and self._blocked:
                self._close_block()
        if self._blocked and self._open > 1:
            for r in self._blocked:  # the blocks since the last add
                self.emit(f"{self._cascade_name(r)}.add({self._acc_names[id(r)]});")

    def _close_block(self) -> None:
        """After a block of the innermost reduce loop: its sums go to the cascades, each block
        accumulator starts again from zero."""
        adds = []
        for r in self._blocked:
            acc = self._acc_names[id(r)]
            adds += [f"{self._cascade_name(r)}.add({acc});", f"{acc} = {self._zero(r)};"]
        if self._open > 1:
            (v, _) = self._dims(reduce=True)[-1]
            self.emit(f"{self._fill} += {v.name}_block_end - {v.name}_block;")
            self.emit(f"if ({self._fill} >= {self._cascade_block}) {{")
            self.indent += 1
            for line in adds + [f"{self._fill} = 0;"]:
                self.emit(line)
            self.indent -= 1
            self.emit("}")
        else:
            for line in adds:
                self.emit(line)
        self.indent -= 1
        self.emit("}")

    def _zero(self, r: KReduce) -> str:
        return self.const(KConst(r.dtype, False, 0, dtypes.reduction_identity(r.kind, r.dtype)))

    def reduce_init(self, acc: str, r: KReduce) -> None:
        if self._cascaded(r):
            # The loop adds into the block's accumulator; the row's sum is the cascade's total.
            self._acc_names[id(r)] = f"{acc}_block"
            self.emit(f"{CPP_DTYPE[r.dtype]} {acc}_block = {self._zero(r)};")
            self.emit(f"ember_cascade<{CPP_DTYPE[r.dtype]}> {acc}_sums;")
            return
        self._acc_names[id(r)] = acc
        self.emit(f"{CPP_DTYPE[r.dtype]} {acc} = {self._zero(r)};")
        if _nan_flagged(r):
            self.emit(f"int {acc}_nan = 0;")

    def reduce_update(self, acc: str, r: KReduce) -> None:
        acc = self._acc_names[id(r)]
        v = self.ref(r.arg)
        if _nan_flagged(r):
            self.emit(_FLOAT_MINMAX[r.kind][1].format(acc=acc, v=v))
            self.emit(f"{acc}_nan |= ({v} != {v});")
        else:
            self.emit(_UPDATE[r.kind].format(acc=acc, v=v))

    def reduce_finalize(self, name: str, acc: str, r: KReduce) -> None:
        t = CPP_DTYPE[r.dtype]
        if self._cascaded(r):
            self.emit(f"{t} {name} = {acc}_sums.total();")
            return
        value = f"({acc}_nan ? static_cast<{t}>(NAN) : {acc})" if _nan_flagged(r) else acc
        self.emit(f"{t} {name} = {value};")

    def signature(self, result: str) -> str:
        """The kernel's `extern "C"` declaration up to its opening brace: buffers as (const) pointers,
        `__restrict__` unless another parameter shares their memory, sizes as int64_t."""
        args = []
        for p in self.params:
            if p.kind == "buffer":
                const = "" if p.written else "const "
                restrict = "" if p.value in self.shared else " __restrict__"
                args.append(f"{const}{CPP_DTYPE[p.value.dtype]}*{restrict} {p.name}")
            else:
                args.append(f"int64_t {p.name}")
        # Where a `where` picks on a condition its vector loop does not change (`ember_pick`), GCC's partial
        # redundancy elimination rewrites a NaN test after a ReLU (`ember_maximum`) as a select of booleans,
        # which its vectorizer does not take: the loop stays scalar (ResNet's stem max pool, 27x slower).
        attributes = "EMBER_NO_PRE " if any(map(self._picks, self.nodes)) else ""  # the prelude's macro
        return f'extern "C" {attributes}{result} {self.kernel.name}({", ".join(args)}) {{'

    def render(self) -> str:
        self._acc_names: dict[int, str] = {}
        k = self.kernel
        self.emit(self.signature("int64_t" if self.checks_rows else "void"))
        self.indent += 1
        if self.checks_rows:
            self.emit("int64_t ember_bad_row = 0;  // set where a row read from an index is out of range")
        elif self.column_tiled():
            self.render_column_tiles()
            self.indent -= 1
            self.emit("}")
            return "\n".join(self.lines)
        outer = self._dims(reduce=False)
        total = product(k.loop_sizes)
        work = print_index(total, "/")
        is_pointwise = not any(k.loop_reduce)
        inner = self._window_interior() if is_pointwise else None
        loops = outer[:-2] if inner else outer  # an interior writes the last two loops itself
        if outer:
            collapse = len(outer) - 1 if is_pointwise and len(outer) > 1 else len(outer)
            simd = " simd" if is_pointwise and len(outer) == 1 and not self.checks_rows else ""
            collapse_clause = f" collapse({collapse})" if collapse > 1 else ""
            if total.is_Integer and int(total) <= self.h.parallel_threshold:
                # Known to run on one thread: no parallel region at all. Entered with if(0), it still
                # costs libgomp's setup, 1.45 us of a 1.8 us call for a 256-element GELU (tiny_mlp's
                # 16 such kernels were most of its gap to Inductor on the 2-core machine).
                if simd:
                    self.emit("#pragma omp simd")
            elif collapse >= 1:
                # `if(parallel: ...)`: a plain `if` on the combined construct applies to its `simd`
                # too (OpenMP 5.0), so a small symbolic-size kernel below the threshold ran unvectorized.
                self.emit(
                    f"#pragma omp parallel for{simd}{collapse_clause} if(parallel: {work} > {self.h.parallel_threshold})"
                )
            for pos, (v, s) in enumerate(loops):
                if is_pointwise and pos == len(outer) - 1 and len(outer) > 1 and not self.checks_rows:
                    self.emit("#pragma omp simd")
                self.emit(f"for (int64_t {v.name} = 0; {v.name} < {print_index(s, '/')}; {v.name}++) {{")
                self.indent += 1
        if inner:
            self._interior_and_rest(inner, outer[-2], outer[-1])
        else:
            self.body()
        for _ in loops:
            self.indent -= 1
            self.emit("}")
        if self.checks_rows:
            self.emit("return ember_bad_row;")
        self.indent -= 1
        self.emit("}")
        return "\n".join(self.lines)


def render_cpp(kernel: Kernel, target: Target, shared: frozenset = frozenset()) -> tuple[str, list]:
    """`shared`: the kernel's buffers whose memory another of its buffers uses (memory.MemoryPlan);
    `target`: whose heuristics shape the loops (heuristics.cpp)."""
    if kernel.column_partials:  # the scheduler fuses them only for targets that render them
        raise NotImplementedError("column sums accumulated by a row kernel are rendered for Triton only")
    r = CppRenderer(kernel, shared, target.heuristics.cpp)
    return r.render(), r.params
