"""Matrix products: ATen extern or ember's GEMM template, and which pointwise ops fuse into it.

Every `mm`, `addmm` and `bmm` the importer left as an extern is looked at once, here:

1. **Eligible?** Float inputs of one dtype (bf16, fp16, fp32), no other arguments than addmm's
   `beta`/`alpha`, a code generator that has a template (Triton; C++ for float32 2-d products).
2. **Template or ATen?** The backend's `GemmChooser` answers for a `GemmProblem` (sizes, dtype,
   operand layouts, device): `gemm=aten|template` forces a side; `auto` measures on the GPU
   once per shape class and caches the timings on disk (backends/gemm_tuning.py). The bytes
   a fused epilogue would save (the product written and read back) are passed along: the
   template wins when its best time beats cuBLAS's plus that round trip.
3. **A template group.** A chosen product becomes a group of the schedule (state.py) whose
   kernel is a `GemmKernel`: the product tile (`KAcc`, fp32) is a leaf of the kernel's
   expression DAG, and everything the group stores (the product itself, and each fused
   epilogue value) is built from it by the same `KernelBuilder` the pointwise kernels use.
   The fusion pass then merges consumer groups into it exactly as it merges any pointwise
   groups, with one extra rule (`merge_refusal`): only pointwise groups that read the
   product's group, over its own output elements (the same shape, or a reshape of it — a
   linear layer over [B, T, C] is a 2-D product viewed as 3-D), may join. No reduction, no
   prologue (a producer of the operands), no second product.

Rounding follows eager: the product (with addmm's bias, in fp32) is rounded to its dtype once,
and the epilogue reads that rounded value, as eager's next op reads the stored tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import sympy
import torch

from ember.ir import dtypes
from ember.ir.graph import Node, Value, layout_of
from ember.ir.sizes import Expr, contiguous_strides, pow2_ceil, product
from ember.ir.views import VIEW_KINDS, broadcast_index, simplify_index
from ember.schedule.cost import KernelCost, size_hint
from ember.schedule.kernel import Domain, Kernel, KIndex, KLoad, KNode, KStore, NotFusable, walk
from ember.schedule.kernel_builder import KernelBuilder

GEMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TileConfig:
    """One point of the template's tuning space."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 4

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} s{self.num_stages} w{self.num_warps}"


@dataclass(frozen=True)
class GemmProblem:
    """What the choice depends on. Sizes are hints (symbolic sizes at 8192)."""

    batch: int
    m: int
    n: int
    k: int
    dtype: torch.dtype
    a_layout: str  # "row" (K contiguous), "col" (M contiguous: a transposed operand), "strided"
    b_layout: str  # "row" (N contiguous), "col" (K contiguous: a transposed operand), "strided"
    device: str  # torch.device string
    static: bool = True  # every size and operand stride known when the graph is compiled
    batched: bool = False  # a bmm (even of batch 1)

    def shape_class(self) -> tuple:
        """Sizes rounded up to powers of two: nearby shapes share one measurement."""
        return tuple(pow2_ceil(x) for x in (self.batch, self.m, self.n, self.k))

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


@dataclass(frozen=True)
class GemmChoice:
    template: bool
    config: TileConfig | None
    reason: str


# (problem, bytes a fused epilogue saves) -> choice. Supplied by the backend; None: no template.
GemmChooser = Callable[[GemmProblem, int], GemmChoice]


@dataclass
class GemmOp:
    """One matrix product run by the template: out[z, m, n] = beta*bias + alpha * sum_k A[z,m,k] B[z,k,n]."""

    node: Node
    a: Value
    b: Value
    bias: Value | None
    alpha: float
    beta: float
    a_strides: tuple[Expr, Expr, Expr]  # (batch, m, k) strides of the tensor the host passes as A
    b_strides: tuple[Expr, Expr, Expr]  # (batch, k, n)
    batch: Expr
    m: Expr
    n: Expr
    k: Expr
    config: TileConfig
    reason: str

    @property
    def out(self) -> Value:
        return self.node.out

    @property
    def batched(self) -> bool:
        return len(self.out.shape) == 3


_TARGETS = {"mm.default": "mm", "addmm.default": "addmm", "bmm.default": "bmm"}


def gemm_kind(node: Node) -> str | None:
    """'mm' | 'addmm' | 'bmm' for an extern matrix product, else None."""
    if node.op != "extern":
        return None
    target = node.attrs["target"]
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return _TARGETS.get(f"{target.overloadpacket.__name__}.{target._overloadname}")


def product_operands(node: Node, kind: str) -> tuple | str:
    """(bias, a, b, alpha, beta) of an extern product of `kind` (gemm_kind), or why they are not a plain
    product's: tensors of one float dtype, constant alpha and beta, a bias of at most two dims."""
    args, kwargs = node.attrs["args"], dict(node.attrs["kwargs"])
    if kind == "addmm":
        if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
            return "addmm with arguments the template does not take"
        bias, a, b = args
        alpha, beta = kwargs.get("alpha", 1), kwargs.get("beta", 1)
    else:
        if len(args) != 2 or kwargs:
            return f"{kind} with arguments the template does not take"
        (a, b), bias, alpha, beta = args, None, 1, 0
    if not all(isinstance(x, Value) for x in (a, b)) or (bias is not None and not isinstance(bias, Value)):
        return "an operand that is not a tensor"
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (alpha, beta)):
        return "a non-constant alpha or beta"
    out = node.out
    if out.dtype not in GEMM_DTYPES or a.dtype != out.dtype or b.dtype != out.dtype:
        return f"dtypes {a.dtype}, {b.dtype} -> {out.dtype} (the template takes bf16, fp16, fp32)"
    if bias is not None and (bias.dtype != out.dtype or len(bias.shape) > 2):
        return "a bias of another dtype or rank"
    return bias, a, b, float(alpha), float(beta)


def per_column(bias: Value, out: Value) -> bool:
    """Whether a product's bias holds one value per column of its 2-d output `out`: [N] or [1, N]."""
    n = out.shape[-1]
    return tuple(bias.shape) in ((n,), (sympy.Integer(1), n))


def _layout(strides: tuple, inner_dims: tuple[int, int]) -> str:
    """'row' if the last dim is contiguous, 'col' if the one before it is, else 'strided'."""
    s_outer, s_inner = strides[inner_dims[0]], strides[inner_dims[1]]
    if s_inner == 1:
        return "row"
    if s_outer == 1:
        return "col"
    return "strided"


def plan_gemms(
    nodes: list[Node],
    chooser: GemmChooser | None,
    operand_strides: Callable[[Value], tuple],
    device: torch.device,
) -> tuple[dict[int, GemmOp], list[tuple[str, bool, str]]]:
    """Which matrix products run as the template: {id(node): GemmOp}, and one (what, chosen, why)
    per product for the fusion log. `operand_strides(v)` is the layout of the tensor the host
    program will hold for v (an input's, an alias's, or a kernel output's row-major one)."""
    plans: dict[int, GemmOp] = {}
    notes: list[tuple[str, bool, str]] = []
    users: dict[Value, list[Node]] = {}
    for node in nodes:
        for v in node.value_inputs():
            users.setdefault(v, []).append(node)
    for node in nodes:
        kind = gemm_kind(node)
        if kind is None:
            continue
        what = f"{kind} -> %{node.out.name} {node.out.type_str}"
        if chooser is None:
            continue  # this code generator has no template: nothing to decide, nothing to report
        parsed = product_operands(node, kind)
        if isinstance(parsed, str):
            notes.append((what, False, f"ATen: {parsed}"))
            continue
        bias, a, b, alpha, beta = parsed
        sa, sb = tuple(operand_strides(a)), tuple(operand_strides(b))
        if kind == "bmm":
            batch, m, k = a.shape
            n = b.shape[2]
            a_str, b_str = sa, sb
        else:
            batch, (m, k), n = sympy.Integer(1), a.shape, b.shape[1]
            a_str, b_str = (sympy.Integer(0), *sa), (sympy.Integer(0), *sb)
        out = node.out
        problem = GemmProblem(
            size_hint(batch), size_hint(m), size_hint(n), size_hint(k), out.dtype,
            _layout(a_str, (1, 2)), _layout(b_str, (1, 2)), str(device),
            all(sympy.sympify(e).is_Integer for e in (batch, m, n, k, *a_str, *b_str)), kind == "bmm",
        )  # fmt: skip
        if min(problem.m, problem.n) == 0:
            notes.append((what, False, "ATen: an empty product"))
            continue
        choice = chooser(problem, _epilogue_bytes(out, users))
        notes.append((what, choice.template, choice.reason))
        if choice.template:
            plans[id(node)] = GemmOp(
                node, a, b, bias, alpha, beta, a_str, b_str, batch, m, n, k, choice.config, choice.reason
            )
    return plans, notes


def _epilogue_bytes(out: Value, users: dict[Value, list[Node]]) -> int:
    """Bytes a fused epilogue would save: the product written and read back, if some pointwise op
    over its elements reads it (through views)."""
    seen, stack = set(), [out]
    while stack:
        v = stack.pop()
        for node in users.get(v, []):
            if node.op == "view" and id(node) not in seen:
                seen.add(id(node))
                stack.append(node.out)
            elif node.op in ("pointwise", "cast") and sympy.expand(product(node.out.shape) - product(out.shape)) == 0:
                return 2 * size_hint(product(out.shape)) * out.dtype.itemsize
    return 0


# -- the kernel ----------------------------------------------------------------------------


@dataclass(eq=False)
class KAcc(KNode):
    """The product tile, in fp32, after the K loop: a leaf of the epilogue's expression DAG."""

    def __repr__(self):
        return "acc"


@dataclass
class GemmKernel(Kernel):
    """A kernel whose values are computed from a matrix product tile (see module doc)."""

    gemm: GemmOp | None = None
    acc: KAcc | None = None

    def extra_cost(self) -> KernelCost:
        """The operand reads and the product's FLOPs, which the expression DAG does not show."""
        g = self.gemm
        reads = (g.batch * g.m * g.k + g.batch * g.k * g.n) * g.out.dtype.itemsize
        return KernelCost(sympy.sympify(reads), sympy.Integer(0), sympy.sympify(2 * g.batch * g.m * g.n * g.k))


def is_gemm_kernel(kernel: Kernel) -> bool:
    return isinstance(kernel, GemmKernel)


class GemmKernelBuilder(KernelBuilder):
    """KernelBuilder over the product's domain whose product value is the accumulator tile."""

    def __init__(self, domain: Domain, group_id: int, owner: dict, gemm: GemmOp, gathers: dict | None = None):
        super().__init__(domain, group_id, owner, gathers=gathers)
        self.gemm = gemm
        self.acc = KAcc(torch.float32, False, 0)
        # The operands come first: the template's A and B pointers (and the host's arguments).
        self.reads.setdefault(gemm.a, None)
        self.reads.setdefault(gemm.b, None)

    def value_index(self, value: Value) -> list[Expr] | None:
        """Where a value of `value.shape` sits at the domain position: the product's own shape,
        or any reshape of it (a 2-D product read as [B, T, N])."""
        dom = self.domain
        if tuple(value.shape) == dom.shape:
            return dom.vars()
        if sympy.expand(product(value.shape) - product(dom.shape)) != 0:
            return None
        index = VIEW_KINDS["reshape"].index(dom.vars(), tuple(value.shape), dom.shape, {"shape": dom.shape})
        return [simplify_index(sympy.expand(i), self.ranges) for i in index]

    def gather(self, gather, index: list[Expr]) -> KNode:
        raise NotFusable(f"the gather %{gather.value.name} in a GEMM template's epilogue")  # it renders no KRow

    def _offset(self, index: list[Expr], shape) -> Expr:
        flat = sum((i * s for i, s in zip(index, contiguous_strides(tuple(shape)))), sympy.Integer(0))
        return simplify_index(sympy.expand(flat), self.ranges)

    def _expr(self, value: Value, index: list[Expr]) -> KNode:
        if value is not self.gemm.out:
            return super()._expr(value, index)
        if sympy.expand(self._offset(index, value.shape) - self._offset(self.domain.vars(), value.shape)) != 0:
            raise NotFusable(f"the product %{value.name} is read at {index}, not at its own element")
        g, f32 = self.gemm, torch.float32
        val: KNode = self.acc
        if g.alpha != 1:
            val = self.op("mul", [val, self.const(g.alpha, f32)], f32)
        if g.bias is not None and g.beta != 0:
            at = broadcast_index(self.domain.vars(), g.bias.shape, value.shape)
            bias = self.convert(self.expr(g.bias, at), f32)
            if g.beta != 1:
                bias = self.op("mul", [bias, self.const(g.beta, f32)], f32)
            val = self.op("add", [bias, val], f32)
        self.record_origin(g.node)
        # Rounded once to the product's dtype, as ATen stores it; the epilogue reads that value.
        return self.convert(self.convert(val, value.dtype), dtypes.compute_dtype(value.dtype))

    def store(self, value: Value) -> KStore:
        index = self.value_index(value)
        if index is None or value.node.op == "reduce":
            raise NotFusable(f"%{value.name} {value.type_str} is not an element-wise epilogue of {self.domain}")
        result = self.expr(value, index)
        stored = self.convert(result, value.dtype)
        offset = sum((i * s for i, s in zip(index, layout_of(value))), sympy.Integer(0))
        return KStore(value, simplify_index(sympy.expand(offset), self.ranges), stored, 0, False)


def build_gemm_kernel(
    name: str,
    domain: Domain,
    group_id: int,
    roots: list[Value],
    stored: list[Value],
    owner: dict,
    gemm: GemmOp,
    gathers: dict | None = None,
) -> GemmKernel:
    """The template kernel computing the product and the epilogue `roots`, storing `stored`. An epilogue
    that reads a gather (`gathers`, schedule/gathers.py) is not fusable."""
    if domain.reduce_dims or tuple(domain.shape) != tuple(gemm.out.shape):
        raise NotFusable(f"a GEMM template iterates over its product's shape, not {domain}")
    b = GemmKernelBuilder(domain, group_id, owner, gemm, gathers)
    stores = [b.store(v) for v in stored]
    for v in roots:
        if v not in stored:
            index = b.value_index(v)
            if index is None or v.node.op == "reduce":
                raise NotFusable(f"%{v.name} {v.type_str} is not an element-wise epilogue of {domain}")
            b.expr(v, index)
    if b.reduces:
        raise NotFusable("a reduction cannot run in a GEMM epilogue")
    kernel = GemmKernel(
        name=name,
        domain=domain,
        stores=stores,
        reduces=[],
        reads=list(b.reads),
        origins=list(b.origins),
        fx_nodes=[n for n in b.fx_nodes if n],
        num_phases=1,
        gemm=gemm,
        acc=b.acc,
    )
    # No dimension merging: the template's loops are the product's (batch, rows, columns).
    kernel.index_vars = domain.vars()
    kernel.loop_sizes = list(domain.shape)
    kernel.loop_reduce = [False] * len(domain.shape)
    exprs = {s.index for s in stores} | {n.index for n in walk(kernel) if isinstance(n, KLoad)}
    exprs |= {n.expr for n in walk(kernel) if isinstance(n, KIndex)}
    kernel.rewritten = {e: e for e in exprs}
    return kernel


# -- the fusion rule ----------------------------------------------------------------------


@dataclass
class GemmGroups:
    """The scheduler's template groups (group id -> its product), and the rule for merging them.

    Groups are state.Group records: `id`, `domain`, `roots`, `kernel`."""

    by_group: dict[int, GemmOp] = field(default_factory=dict)

    def _split(self, a, b):
        return (a, b) if a.id in self.by_group else (b, a)

    def merged_domain(self, a, b) -> Domain | None:
        """The template's domain, if the other group's values are its elements (same count, no reduction)."""
        tmpl, other = self._split(a, b)
        if other.domain.reduce_dims:
            return None
        n = product(tmpl.domain.shape)
        if all(sympy.expand(product(v.shape) - n) == 0 and v.node.op != "reduce" for v in other.roots):
            return tmpl.domain
        return None

    def merge_refusal(self, a, b) -> str | None:
        """Why a and b may not merge when one is a template group (None: they may, or neither is).
        The other group must be an epilogue: pointwise over the product's elements, reading a
        value the template group computes."""
        if a.id not in self.by_group and b.id not in self.by_group:
            return None
        if a.id in self.by_group and b.id in self.by_group:
            return "two matrix products do not share a GEMM template"
        tmpl, other = self._split(a, b)
        if other.domain.reduce_dims:
            return f"a GEMM epilogue is element-wise; {other.domain} reduces"
        if self.merged_domain(a, b) is None:
            return f"not over the product's elements ({other.domain} vs {tmpl.domain})"
        if not set(tmpl.roots) & set(other.kernel.reads):
            return "not an epilogue: it does not read the product (prologues are not fused into a GEMM)"
        return None
