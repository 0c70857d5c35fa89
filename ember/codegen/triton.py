"""Render a kernel as Triton source.

Outer loop dims are flattened into `xindex` (XBLOCK per program); reduce dims into
`rindex`, either held whole in registers (persistent: RBLOCK >= the row) or looped over in
RBLOCK chunks. Loop variables are recovered from the flat indices with // and %, only
where some index needs them. Block sizes and warps come from triton_launch.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import sympy
import torch

from ember.codegen.render import Param, Renderer, is_scalar, print_index, unclamped
from ember.codegen.triton_launch import LaunchConfig, launch_config
from ember.ir import dtypes, ops
from ember.ir.graph import layout_of
from ember.ir.sizes import product
from ember.schedule.kernel import KConst, KConvert, Kernel, KIndex, KLoad, KNode, KOp, KReduce, KRow, KStore
from ember.target import Target

TRITON_DTYPE = {
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.bfloat16: "tl.bfloat16",
    torch.float16: "tl.float16",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
    torch.int16: "tl.int16",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}

PRELUDE = """\
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def ember_maximum(a, b):
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def ember_minimum(a, b):
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def ember_round_bf16(x):
    # Only for Triton's CPU interpreter, whose fp32 -> bf16 conversion truncates.
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


_EMBER_NAN: tl.constexpr = float("nan")
_EMBER_INF: tl.constexpr = float("inf")


@triton.jit
def ember_pow(x, y):
    # Only for Triton's CPU interpreter, which has no libdevice: |x|^y as exp2(y * log2|x|), then C's
    # rules: a negative base (-0.0 included) keeps its sign under an odd integer exponent and gives NaN
    # under a fractional one (-inf excepted); x^0, 1^y and (+-1)^+-inf are 1.
    x, y = tl.where(True, x, y), tl.where(True, y, x)  # both blocks, when one is a literal
    ax, whole = tl.abs(x), tl.floor(y) == y
    odd = whole & (tl.floor(y * 0.5) * 2.0 != y)
    r = tl.exp2(y * tl.log2(ax))
    r = tl.where(((x < 0) | ((x == 0) & (1.0 / x < 0))) & odd, -r, r)
    r = tl.where((x < 0) & (x > -_EMBER_INF) & ~whole, _EMBER_NAN, r)
    return tl.where((y == 0) | (x == 1) | ((ax == 1) & (tl.abs(y) == _EMBER_INF)), 1.0, r)


@triton.jit
def _sum_combine(a, b):
    return a + b


@triton.jit
def _prod_combine(a, b):
    return a * b


@triton.jit
def ember_reduce_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, ember_maximum, keep_dims=True)


@triton.jit
def ember_reduce_min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, ember_minimum, keep_dims=True)


@triton.jit
def ember_reduce_extreme_interpreted(x, axis: tl.constexpr, maximum: tl.constexpr):
    # Only for Triton's CPU interpreter, which runs a custom combine function (ember_maximum, ember_minimum)
    # in Python element by element: NumPy's max or min of the block, NaN where the block holds one (as the
    # combine functions give; NaN is set aside first, NumPy warning of slices of nothing but NaN), in x's
    # dtype (tl.max and tl.min widen types narrower than 32 bits, which the combine functions keep).
    y = x
    if x.dtype.is_floating():
        y = tl.where(x != x, -_EMBER_INF if maximum else _EMBER_INF, x)
    m = tl.max(y, axis, keep_dims=True) if maximum else tl.min(y, axis, keep_dims=True)
    if x.dtype.is_floating():
        m = tl.where(tl.max((x != x).to(tl.int8), axis, keep_dims=True) != 0, _EMBER_NAN, m)
    return m.to(x.dtype)


@triton.jit
def ember_reduce_sum(x, axis: tl.constexpr):
    return tl.sum(x, axis, keep_dims=True)


@triton.jit
def ember_reduce_prod(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _prod_combine, keep_dims=True)


def ember_interpreted_assert(ok, message):
    # Triton's interpreter compiles no debug mode and drops tl.device_assert: there the kernel
    # (plain Python) calls this instead.
    if not ok.handle.data.all():
        raise IndexError(message)
"""

_COMBINE = {
    "sum": "({a} + {b})",
    "max": "ember_maximum({a}, {b})",
    "min": "ember_minimum({a}, {b})",
    "prod": "({a} * {b})",
}


class TritonRenderer(Renderer):
    def __init__(self, kernel: Kernel, launch: LaunchConfig, interpreted: bool, narrow: bool = False):
        super().__init__(kernel)
        self.launch = launch
        self.reduction = any(kernel.loop_reduce)
        # Reductions whose reduce dims all had size 1 (merge_dims dropped them) reduce one element:
        # each result is its argument, computed in the row's own scope with no r-loop or RBLOCK.
        self.single_element = bool(kernel.reduces) and not self.reduction
        self.persistent = launch.persistent or self.single_element
        # `narrow`: 32-bit index math whatever the sizes (render_triton's form of a symbolic kernel,
        # launched only while its extents are small enough: narrow_guard).
        self.wide_index = not narrow and self._needs_int64()
        # Triton's CPU interpreter (the target's): its fp32 -> bf16 conversion truncates, and
        # some ops render another way there.
        self.interpreted = interpreted

    def _needs_int64(self) -> bool:
        for p in self.params:
            if p.kind == "size":
                return True
        for v in self.kernel.reads + self.kernel.writes:
            numel = product(v.shape)
            # A symbolic size can grow past int32 on a later call without a recompile: be conservative.
            if not numel.is_Integer or int(numel) >= 2**31 - 1:
                return True
        return False

    # -- shapes and masks ----------------------------------------------------------------
    def mask(self, full: bool) -> str:
        return "xmask & rmask" if full and self.reduction else "xmask"

    def shape(self, full: bool) -> str:
        if not self.reduction:
            return "[XBLOCK]"
        return "[XBLOCK, RBLOCK]" if full else "[XBLOCK, 1]"

    # -- node rendering ------------------------------------------------------------------
    def const(self, node: KConst) -> str:
        v = node.value
        if isinstance(v, bool):
            return "True" if v else "False"  # a bool, not an int32 (tl.where conditions)
        if isinstance(v, float):
            if math.isnan(v):
                return 'float("nan")'
            if math.isinf(v):
                return 'float("inf")' if v > 0 else 'float("-inf")'
            return repr(v)
        return str(v)

    def index_of(self, expr) -> str:
        return print_index(self.kernel.index(expr), "//")

    def define(self, name: str, node: KNode) -> None:
        if isinstance(node, KLoad):
            ptr = self.buffer_name(node.buffer)
            if not self._varies(node.index):
                # One element for the whole kernel (a 0-d input): a scalar load needs no mask.
                self.emit(f"{name} = tl.load({ptr} + {self.index_of(node.index)})")
            else:
                index, inside = unclamped(self.kernel.index(node.index), set(self.kernel.index_vars), "//")
                mask = " & ".join([self.mask(node.full)] + inside)
                self.emit(f"{name} = tl.load({ptr} + {self._block_offset(index)}, {mask}, other=0)")
        elif isinstance(node, KRow):
            self._define_row(node)
        elif isinstance(node, KIndex):
            self.emit(f"{name} = {self.index_of(node.expr)}")
        elif isinstance(node, KConvert):
            arg = self.ref(node.arg)
            if node.dtype == torch.bool:
                self.emit(f"{name} = {arg} != 0")
            elif self.interpreted and node.dtype == torch.bfloat16:
                # The interpreter truncates fp32 -> bf16 (round to nearest even as the GPU does), and
                # reinterprets the bits of an integer or bool as bf16 (True became 9.2e-41): go through fp32.
                src = arg if node.arg.dtype == torch.float32 else f"{arg}.to(tl.float32)"
                self.emit(f"{name} = ember_round_bf16({src})")
            else:
                self.emit(f"{name} = {arg}.to({TRITON_DTYPE[node.dtype]})")
        elif isinstance(node, KOp):
            spec = ops.POINTWISE[node.fn]
            template = spec.triton
            if self.interpreted and spec.triton_interpreted is not None:
                template = spec.triton_interpreted
                if not template:
                    raise NotImplementedError(f"{node.fn} has no form for Triton's interpreter")
            self.emit(f"{name} = {template.format(*[self.ref(a) for a in node.operands])}")
        else:
            raise NotImplementedError(type(node).__name__)

    def _tensor(self, node: KNode, full: bool) -> str:
        """A reference usable where a block-shaped tensor is required."""
        if is_scalar(node) or not self._value_varies(node):
            return f"tl.full({self.shape(full)}, {self.ref(node)}, {TRITON_DTYPE[node.dtype]})"
        return self.ref(node)

    def _block_offset(self, index) -> str:
        """A masked load's or store's offset, printed as a block: one that no loop variable moves (one element,
        or rows each one value, read at a 0-d index) gets `+ tl.zeros_like(xindex)`, so that the mask applies."""
        offset = print_index(index, "//")
        return offset if index.free_symbols & set(self.kernel.index_vars) else offset + " + tl.zeros_like(xindex)"

    def _value_varies(self, node: KNode) -> bool:
        """Whether node's value is a block: it depends on a loop variable or on a row read at one (a value
        loaded at a 0-d index's row is one value, which `tl.atomic_add` does not broadcast to its mask)."""
        if isinstance(node, KConst):
            return False
        if isinstance(node, KLoad):
            return self._varies(node.index)
        if isinstance(node, KIndex):
            return self._varies(node.expr)
        if isinstance(node, (KOp, KConvert, KRow)):
            return any(self._value_varies(a) for a in node.args())
        return True  # a reduction's result, a GEMM's accumulator, ...: a block

    def _varies(self, index) -> bool:
        """Whether an index expression depends on a loop variable, directly or through a row the kernel
        reads from an index tensor (else it names one element)."""
        return bool(self.kernel.index(index).free_symbols & self._varying)

    @functools.cached_property
    def _varying(self) -> set:
        rows = {n.symbol for n in self.nodes if isinstance(n, KRow) and not is_scalar(n)}
        return set(self.kernel.index_vars) | rows

    def emit_store(self, store: KStore) -> None:
        ptr = self.buffer_name(store.buffer)
        value = self._tensor(store.value, store.full)
        if store.row is not None:
            self.emit_node(store.row)  # a store in a reduce phase is emitted there, with its operands
        offset = self._block_offset(self.kernel.index(store.index))
        if store.accumulate:
            # Programs add into the same elements in any order (eager's CUDA scatter_add does too).
            self.emit(f'tl.atomic_add({ptr} + {offset}, {value}, {self.mask(store.full)}, sem="relaxed")')
        else:
            self.emit(f"tl.store({ptr} + {offset}, {value}, {self.mask(store.full)})")

    def _define_row(self, row: KRow) -> None:
        """Define the row a load or store reaches (kernel.KRow) and check it as eager's device-side
        check does: an index outside the buffer stops the kernel instead of reading or writing another
        tensor's memory."""
        name, position, size = row.symbol.name, self.ref(row.position), print_index(row.size, "//")
        if row.wrap:
            self.emit(f"{name} = tl.where({position} < 0, {position} + {size}, {position})")
        else:
            self.emit(f"{name} = {position}")
        inside = f"((0 <= {name}) & ({name} < {size})) | ~({self.mask(row.full)})"
        check = "ember_interpreted_assert" if self.interpreted else "tl.device_assert"
        self.emit(f'{check}({inside}, "index out of bounds: {row.origin}")')

    # -- phases ----------------------------------------------------------------------------
    def open_phase(self, phase: int) -> None:
        if self.persistent:
            return
        self._blocked = [r for r in self.kernel.reduces if id(r) in self.accs and self._cascaded(r)]
        end = "rnumel"
        if self._blocked:
            # Each lane of a long row adds cascade_steps steps into a block accumulator from zero,
            # then the block into the row's (a row of 10^8 had each of 2048 lanes add 48,828
            # elements in a row).
            span = f"RBLOCK * {self.launch.cascade_steps}"
            self.emit(f"for rblock in range(0, rnumel, {span}):")
            self.indent += 1
            for r in self._blocked:
                self.emit(f"{self.accs[id(r)]}_block = tl.zeros([XBLOCK, RBLOCK], {TRITON_DTYPE[r.dtype]})")
            # The inner loop counts from 0: from `rblock`, a single-program sum over 2^24 + 43
            # elements took 7.9 ms, where the loop without blocks took 4.1 (H100).
            end = f"tl.minimum({span}, rnumel - rblock)"
        stages = self.launch.loop_stages
        walk = f"tl.range(0, {end}, RBLOCK, num_stages={stages})" if stages else f"range(0, {end}, RBLOCK)"
        self.emit(f"for roffset in {walk}:")
        self.indent += 1
        self.emit(f"rindex = {'rblock + ' if self._blocked else ''}roffset + rbase")
        self.emit("rmask = rindex < rnumel")
        self._emit_loop_vars(reduce=True)

    def close_phase(self) -> None:
        if self.persistent:
            return
        self.indent -= 1
        if self._blocked:
            for r in self._blocked:
                acc = self.accs[id(r)]
                self.emit(f"{acc} = {acc} + {acc}_block")
            self.indent -= 1

    def _cascaded(self, r: KReduce) -> bool:
        """Whether a looped floating sum adds each lane's steps in blocks (LaunchConfig.cascade_steps)."""
        steps = self.launch.cascade_steps
        if self.persistent or not steps or r.kind != "sum" or not r.dtype.is_floating_point:
            return False
        rnumel = product(s for s, red in zip(self.kernel.loop_sizes, self.kernel.loop_reduce) if red)
        return not (rnumel.is_Integer and int(rnumel) <= self.launch.rblock * steps)

    def _identity(self, r: KReduce) -> str:
        ident = dtypes.reduction_identity(r.kind, r.dtype)
        return self.const(KConst(r.dtype, False, 0, ident))

    def reduce_init(self, acc: str, r: KReduce) -> None:
        if r.kind == "sumexp":
            if self.persistent:
                raise NotImplementedError("online softmax is for looped reductions (schedule/online.py)")
            self.emit(f"{acc} = tl.zeros([XBLOCK, RBLOCK], {TRITON_DTYPE[r.dtype]})")
        elif not self.persistent:
            self.emit(f"{acc} = tl.full([XBLOCK, RBLOCK], {self._identity(r)}, {TRITON_DTYPE[r.dtype]})")

    def reduce_update(self, acc: str, r: KReduce) -> None:
        if r.kind == "sumexp":
            self._online_update(acc, r)
            return
        if self.single_element:
            self.emit(f"{acc} = {self._tensor(r.arg, False)}")
            return
        masked = f"tl.where(xmask & rmask, {self.ref(r.arg)}, {self._identity(r)})"
        if self.persistent:
            self.emit(f"{acc} = {masked}")
        elif self._cascaded(r):
            self.emit(f"{acc}_block = {acc}_block + {masked}")
        else:
            self.emit(f"{acc} = {_COMBINE[r.kind].format(a=acc, b=masked)}")

    def _online_update(self, acc: str, r: KReduce) -> None:
        """s' = s * exp(m - m') + exp(x - m'), m' = max(m, x), per lane (m: the partner's acc,
        updated after this). Where m' is -inf (only -inf seen yet, or masked lanes) shift by 0
        instead: the lane's sum stays 0 rather than exp(-inf - -inf) = nan."""
        m = self.accs[id(r.online_max)]
        x = f"tl.where(xmask & rmask, {self.ref(r.arg)}, float('-inf'))"
        new, shift = self.fresh("mnew"), self.fresh("shift")
        self.emit(f"{new} = ember_maximum({m}, {x})")
        self.emit(f"{shift} = tl.where({new} == float('-inf'), 0.0, {new})")
        self.emit(f"{acc} = {acc} * tl.exp({m} - {shift}) + tl.exp({x} - {shift})")

    def reduce_finalize(self, name: str, acc: str, r: KReduce) -> None:
        if r.kind == "sumexp":
            # Lanes rescaled to the row's max; a row of nothing but -inf gives nan, as eager's
            # exp(x - max) does.
            m = self.accs[id(r.online_max)]
            self.emit(f"{name} = ember_reduce_sum({acc} * tl.exp({m} - {self._reduced('max', m, 1)}), 1)")
            return
        if self.single_element:
            self.emit(f"{name} = {acc}")
            return
        self.emit(f"{name} = {self._reduced(r.kind, acc, 1)}")

    def _reduced(self, kind: str, block: str, axis: int) -> str:
        """The prelude's reduction of `block` along `axis`; under Triton's interpreter, max and min through
        NumPy's (the interpreter runs a custom combine function per element, in Python)."""
        if self.interpreted and kind in ("max", "min"):
            return f"ember_reduce_extreme_interpreted({block}, {axis}, {kind == 'max'})"
        return f"ember_reduce_{kind}({block}, {axis})"

    # -- whole kernel ------------------------------------------------------------------------
    def _emit_loop_vars(self, reduce: bool) -> None:
        k = self.kernel
        dims = [(v, s) for v, s, r in zip(k.index_vars, k.loop_sizes, k.loop_reduce) if r == reduce]
        flat = "rindex" if reduce else "xindex"
        used = set()
        for e in k.rewritten.values():
            used |= e.free_symbols
        inner = sympy.Integer(1)
        for pos in range(len(dims) - 1, -1, -1):
            var, size = dims[pos]
            if var in used:
                expr = f"{flat} // {print_index(inner, '//')}" if inner != 1 else flat
                expr = f"({expr}) % {print_index(size, '//')}" if pos > 0 else expr
                self.emit(f"{var.name} = {expr}")
            inner = inner * size

    def render(self) -> str:
        k = self.kernel
        args = [p.name for p in self.params] + ["xnumel"]
        if self.reduction:
            args.append("rnumel")
        args += ["XBLOCK: tl.constexpr"] + (["RBLOCK: tl.constexpr"] if self.reduction else [])
        self.emit(jit_decorator([k]))
        self.emit(f"def {k.name}({', '.join(args)}):")
        self.indent += 1
        pid = "tl.program_id(0).to(tl.int64)" if self.wide_index else "tl.program_id(0)"
        if k.column_partials:
            self._render_column_partials(pid)
            return "\n".join(self.lines)
        self.emit(f"xoffset = {pid} * XBLOCK")
        if self.reduction:
            self.emit("xindex = xoffset + tl.arange(0, XBLOCK)[:, None]")
        else:
            self.emit("xindex = xoffset + tl.arange(0, XBLOCK)")
        self.emit("xmask = xindex < xnumel")
        self._emit_loop_vars(reduce=False)
        if self.reduction:
            self._emit_rbase()
            if self.persistent:
                self._emit_whole_row()
        self.body()
        self.emit("return")
        return "\n".join(self.lines)

    def _emit_rbase(self) -> None:
        cast = ".to(tl.int64)" if self.wide_index else ""
        self.emit(f"rbase = tl.arange(0, RBLOCK)[None, :]{cast}")

    def _emit_whole_row(self) -> None:
        """A persistent row: the whole of it is one block of RBLOCK lanes."""
        self.emit("rindex = rbase")
        self.emit("rmask = rindex < rnumel")
        self._emit_loop_vars(reduce=True)

    def _render_column_partials(self, pid: str) -> None:
        """A row kernel that also reduces its rows' columns (kernel.KColumnPartial): each program
        walks one chunk of rows, XBLOCK at a time, holding a whole row (persistent), and adds each
        column sum's terms into an [XBLOCK, RBLOCK] accumulator; the rows of the accumulator are
        combined once, after the chunk, and stored as the chunk's partial row."""
        k, rows = self.kernel, self.launch.rows_per_program
        assert self.persistent and rows % self.launch.xblock == 0, "a chunk is whole row blocks"
        self.emit(f"chunk = {pid}")
        self._emit_rbase()
        self._emit_whole_row()
        accs = [self.fresh("colacc") for _ in k.column_partials]
        idents = [
            self.const(KConst(c.arg.dtype, False, 0, dtypes.reduction_identity(c.kind, c.arg.dtype)))
            for c in k.column_partials
        ]
        for acc, ident, c in zip(accs, idents, k.column_partials):
            self.emit(f"{acc} = tl.full([XBLOCK, RBLOCK], {ident}, {TRITON_DTYPE[c.arg.dtype]})")
        stages = self.launch.loop_stages
        walk = f"tl.range(0, {rows}, XBLOCK, num_stages={stages})" if stages else f"range(0, {rows}, XBLOCK)"
        self.emit(f"for xstep in {walk}:")
        self.indent += 1
        self.emit(f"xindex = chunk * {rows} + xstep + tl.arange(0, XBLOCK)[:, None]")
        self.emit("xmask = xindex < xnumel")
        self._emit_loop_vars(reduce=False)
        self.body()
        for acc, ident, c in zip(accs, idents, k.column_partials):
            self.emit_node(c.arg)
            masked = f"tl.where(xmask & rmask, {self._tensor(c.arg, True)}, {ident})"
            self.emit(f"{acc} = {_COMBINE[c.kind].format(a=acc, b=masked)}")
        self.indent -= 1
        for acc, c in zip(accs, k.column_partials):
            total = self.fresh("colsum")
            self.emit(f"{total} = {self._reduced(c.kind, acc, 0)}")
            ptr = self.buffer_name(c.buffer)
            offset = f"chunk * {print_index(c.chunk_stride, '//')} + {self.index_of(c.column)}"
            self.emit(f"tl.store({ptr} + {offset}, {total}.to({TRITON_DTYPE[c.buffer.dtype]}), rmask)")
        self.emit("return")


@dataclass
class TritonKernelSource:
    kernel: Kernel
    source: str
    params: list[Param]
    launch: LaunchConfig
    # A kernel of symbolic sizes: the extents it indexes (narrow_guard), and `source` holds two
    # functions, the kernel with 32-bit index math under its own name, run while every one of these
    # is below launch.symbolic_int32_below, and with 64-bit math as NAME_wide. (): one function.
    guard: tuple = ()

    @property
    def xnumel(self):
        return product(s for s, r in zip(self.kernel.loop_sizes, self.kernel.loop_reduce) if not r)

    @property
    def rnumel(self):
        return product(s for s, r in zip(self.kernel.loop_sizes, self.kernel.loop_reduce) if r)


def jit_decorator(kernels: list[Kernel]) -> str:
    """`@triton.jit`, compiled in debug mode where a kernel checks the rows it gathers or stores at
    (TritonRenderer._define_row): Triton drops device asserts otherwise. Functions a kernel calls are
    compiled with its options. The launch turns off debug mode's checks of 32-bit index arithmetic for
    overflow (backends/compile_workers.py: KERNEL_OPTIONS), which eager's indexing does not make either."""
    checks = any(k.checks_rows for k in kernels)
    return "@triton.jit(debug=True)" if checks else "@triton.jit"


def render_triton(kernel: Kernel, target: Target, launch: LaunchConfig | None = None) -> TritonKernelSource:
    """The kernel's source, launched as `launch` says (default: launch_config's choice; the tuner
    passes its candidates, codegen/triton_tuning.py)."""
    launch = launch or launch_config(kernel, target)
    r = TritonRenderer(kernel, launch, target.interpreted)
    source = r.render()
    guard = narrow_guard(kernel, target.heuristics.launch.symbolic_int32_below) if r.wide_index else ()
    if guard:
        # 64-bit index math costs a memory-bound kernel little, but its divisions and remainders (a
        # loop variable recovered from a flat index) take several times the instructions of 32-bit ones.
        narrow = TritonRenderer(kernel, launch, target.interpreted, narrow=True).render()
        source = narrow + "\n\n\n" + source.replace(f"def {kernel.name}(", f"def {kernel.name}_wide(", 1)
    return TritonKernelSource(kernel, source, r.params, launch, guard)


def narrow_guard(kernel: Kernel, limit: int) -> tuple:
    """The symbolic extents a kernel indexes: its loop domain and each buffer's (1 + the sum of
    (size - 1) * stride), and each symbolic stride (a stride of a size-1 dim is in no extent, yet
    passed as a 32-bit size), one of each set that differ by a constant factor (the largest), all of
    which must stay below `limit` for 32-bit index math to hold. () for a kernel of static sizes,
    or one with a static extent of `limit` or more (it keeps 64-bit math)."""
    extents = [product(kernel.loop_sizes)]
    for v in list(kernel.reads) + list(kernel.writes):
        layout = layout_of(v)
        extents.append(1 + sum(((n - 1) * st for n, st in zip(v.shape, layout)), sympy.Integer(0)))
        extents += [st for st in layout if not sympy.sympify(st).is_Integer]
    kept: list = []
    for e in (sympy.expand(e) for e in extents):
        if e.is_Integer:
            if int(e) >= limit:
                return ()
            continue
        if any(_at_least(other / e) for other in kept):
            continue  # another term is as large at every size
        kept = [other for other in kept if not _at_least(e / other)] + [e]
    return tuple(kept)


def _at_least(ratio) -> bool:
    """Whether a ratio of two extents is at least 1 at every size of 1 or more: a number of at least 1,
    or such a number times a product of size symbols (768 * s0 * s1 over 768 * s0 is s1)."""
    ratio = sympy.simplify(ratio)
    coeff, rest = ratio.as_coeff_Mul()
    if not coeff.is_number or coeff < 1:
        return False
    return all(
        f == 1 or f.is_Symbol or (f.is_Pow and f.base.is_Symbol and f.exp.is_Integer and f.exp > 0)
        for f in sympy.Mul.make_args(rest)
    )
