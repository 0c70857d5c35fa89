"""FlexAttention's kernels built and called: each `flex_attention` extern of a schedule (its target an
ir/flex.py `FlexAttention`) gets a `FlexKernel`, the compiled flash-attention kernel of its spec for
the Target's code generator (C++ on the CPU, Triton on a GPU or in Triton's interpreter), with the
Target's tiles (`heuristics.flex`). The host program calls it as it calls any extern: it allocates
out, lse and max in the op's layouts, reads sizes and strides from its operands and launches.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ember import config, log
from ember.backends.direct_launch import BoundLaunch, DirectLaunch, allocator, load_triton
from ember.codegen.cpp import PRELUDE
from ember.codegen.flex_cpp import render_flex_cpp
from ember.codegen.flex_triton import CONTIGUOUS_STEPS, FlexLaunch, block_sizes, even, pow2, render_flex_triton, steps
from ember.codegen.flex_triton_bwd import render_flex_triton_bwd
from ember.ir.flex import FlexAttention, FlexAttentionBackward, FlexBackwardSpec, FlexSpec
from ember.ir.sizes import contiguous_strides
from ember.schedule.steps import ExternStep, Schedule
from ember.target import Target


def build_flex_kernels(sched: Schedule, target: Target) -> int:
    """Give each flex_attention extern of `sched` its kernel, and each flex_attention_backward extern
    its kernels where the code generator has them (Triton); returns how many kernels were built."""
    built = 0
    for step in sched.steps:
        if not isinstance(step, ExternStep):
            continue
        fn = step.node.attrs["target"]
        if isinstance(fn, FlexAttention):
            step.node.attrs["target"] = FlexKernel(fn.spec, target, len(step.node.attrs["output_positions"]))
            built += 1
        elif isinstance(fn, FlexAttentionBackward) and fn.spec is not None:
            if target.name == "cpp":
                log.warn("ember: flex_attention_backward runs as PyTorch's op (no C++ backward kernel)")
                continue
            step.node.attrs["target"] = FlexBackwardKernel(fn.spec, target)
            built += 1
    return built


def atomic_dq(spec: FlexSpec) -> bool:
    """Whether the backward adds dq up atomically in its dk/dv kernel (codegen/flex_triton_bwd.py): for
    float32 inputs, whose products run in full precision off the tensor cores, so that the two scores'
    products the dq kernel would compute again are the cost (docs/decisions.md, "FlexAttention's float32
    backward adds dq up atomically"); under the setting `flex_atomic_dq`, and not under deterministic
    algorithms, whose dq must not depend on the order of adds."""
    return (
        spec.dtype == torch.float32
        and config.get("flex_atomic_dq")
        and not torch.are_deterministic_algorithms_enabled()
    )


def forward_launch(spec: FlexSpec, target: Target) -> FlexLaunch:
    h = target.heuristics.flex
    if target.name == "cpp":
        tile = h.cpu
    elif spec.dtype == torch.float32:
        tile = h.float32
    elif any(p is not None and p.gathers({1, 2}) for p in (spec.score, spec.mask)):
        tile = h.gathering if spec.head_dim <= 128 else h.large
    elif spec.head_dim <= 64 and spec.mask is not None:
        return FlexLaunch(h.masked.xblock, h.masked.rblock, h.masked.warps, h.masked_stages)
    else:
        tile = h.small if spec.head_dim <= 64 else h.medium if spec.head_dim <= 128 else h.large
    return FlexLaunch(tile.xblock, tile.rblock, tile.warps, h.stages)


def backward_launches(spec: FlexSpec, target: Target) -> tuple[FlexLaunch, FlexLaunch]:
    """The launches of the backward's dq kernel and its dk/dv kernel."""
    h = target.heuristics.flex
    if spec.dtype == torch.float32:
        tiles, stages = (h.backward_float32,) * 2, h.stages
    elif spec.mask is not None and spec.head_dim <= 128:
        tiles, stages = (h.backward_masked,) * 2, h.masked_stages
    elif spec.head_dim <= 64:
        tiles, stages = (h.backward_small,) * 2, h.stages
    elif spec.head_dim <= 128:
        tiles, stages = (h.backward_dq, h.backward_dkdv), h.stages
    else:
        tiles, stages = (h.backward_other,) * 2, h.stages
    dq, dkdv = (FlexLaunch(t.xblock, t.rblock, t.warps, stages) for t in tiles)
    return dq, dkdv


class FlexKernel:
    """A flex_attention call's compiled kernel, called with the extern's operands."""

    fresh_result = True

    def __init__(self, spec: FlexSpec, target: Target, results: int):
        self.spec, self.results = spec, results
        self.launch = forward_launch(spec, target)
        self.plans: dict[tuple, CallPlan] = {}  # by the operands' sizes, strides and dtypes
        self.__name__ = "flex_attention_kernel"  # the host program's name for it
        self.cpp = target.name == "cpp"
        if self.cpp:
            source = PRELUDE + render_flex_cpp(spec, "flex_fwd", self.launch.block_m, self.launch.block_n)
            self.source = source
            self.fn = _compile_cpp(source, target)
        else:
            self.source = render_flex_triton(spec, "flex_fwd", self.launch, target.interpreted)
            self.fn = DirectLaunch(_load_flex(self.source, "ember_flex").flex_fwd, target.interpreted)

    def __call__(self, q, k, v, kv_num, kv_idx, *rest):
        spec = self.spec
        blocks, rest = (
            ((spec.q_block, spec.kv_block), rest) if spec.q_block else ((int(rest[-2]), int(rest[-1])), rest[:-2])
        )
        operands = (q, k, v, kv_num, kv_idx, *rest)  # rest: the full blocks' count and index, then captured tensors
        key = (blocks, q.device, *[(t.shape, t.stride(), t.dtype) for t in operands])
        plan = self.plans.get(key)
        made = plan is None
        if made:
            plan = _kept(self.plans, key, self._plan(blocks, operands))
        empty = plan.empty
        out = empty(*plan.out)
        lse = empty(*plan.stats)
        mx = empty(*plan.stats)
        if plan.launch is not None:
            plan.launch((q, k, v, out, lse, mx, kv_num, kv_idx, *rest))
            if made and isinstance(plan.launch, BoundLaunch):
                self.launch = plan.launch.launch  # fewer stages where shared memory ran out: the next plans' start
        return (out, lse, mx)[: self.results]

    def _plan(self, blocks: tuple[int, int], operands: tuple) -> CallPlan:
        """What a call with these operands' sizes and strides launches, worked out once: the results'
        layouts, the kernel's integer parameters, grid and constants."""
        spec = self.spec
        q, k, v, kv_num, kv_idx, *rest = operands
        q_block, kv_block = blocks
        full = tuple(rest[:2]) if spec.has_full_blocks else ()
        buffers = rest[2:] if spec.has_full_blocks else rest
        B, H, M, _ = q.shape
        N = k.shape[2]
        out_layout = (*_like_query(q, spec.value_dim), q.dtype)
        stats = ((B, H, M), (H * M, M, 1), spec.work_dtype)
        plan = CallPlan(allocator(q.device), out_layout, stats)
        if B == 0 or H == 0 or M == 0:
            return plan
        # A key/value batch of 1 serves every query batch (eager broadcasts it).
        kb_stride = 0 if k.shape[0] == 1 and B > 1 else k.stride(0)
        vb_stride = 0 if v.shape[0] == 1 and B > 1 else v.stride(0)
        full_num, full_idx = full if full else (kv_num, kv_idx)
        ints = [B, H, M, N, H // k.shape[1], kv_num.shape[0], kv_num.shape[1]]
        ints += [*q.stride(), kb_stride, *k.stride()[1:], vb_stride, *v.stride()[1:], *out_layout[1]]
        ints += [*kv_num.stride(), *kv_idx.stride(), *full_num.stride(), *full_idx.stride()]
        buf_ints = [x for buf in buffers for x in (*buf.shape, *buf.stride())]
        _check_index_range(buffers)
        if self.cpp:
            params = (ctypes.c_int64 * (len(ints) + 2 + len(buf_ints)))(*ints, q_block, kv_block, *buf_ints)
            plan.launch = _CppCall(self.fn, params)
            return plan
        block_m, block_n, d_pad, dv_pad = block_sizes(spec, self.launch, q_block, kv_block)
        grid = ((M + block_m - 1) // block_m, B * H)
        kv_steps = steps(kv_block, N, block_n)
        consts = {
            "QB": q_block,
            "KB": kv_block,
            "D": spec.head_dim,
            "DV": spec.value_dim,
            "D_PAD": d_pad,
            "DV_PAD": dv_pad,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "EVEN_N": even(kv_block, N, block_n),
            "KV_NESTED": kv_steps >= CONTIGUOUS_STEPS,
        }
        plan.launch = BoundLaunch(self.fn, grid, (*ints, *buf_ints, kv_steps), consts, self.launch)
        return plan


# Call plans kept per kernel: a static graph's calls need one; sizes that vary add one per set of them.
_PLANS_KEPT = 64


def _kept(plans: dict, key: tuple, plan):
    """`plan`, kept in `plans` under `key` (all of them dropped first where there are _PLANS_KEPT)."""
    if len(plans) >= _PLANS_KEPT:
        plans.clear()
    plans[key] = plan
    return plan


@dataclass
class CallPlan:
    """A flex kernel call's work for one set of operand sizes and strides: `empty` and the (size, stride,
    dtype) of the results it allocates, and the launch taking their tensors (None: nothing to compute)."""

    empty: Callable
    out: tuple
    stats: tuple
    launch: Callable | None = None


class _CppCall:
    """The C++ kernel called with its tensors' addresses and the integer parameters made once."""

    def __init__(self, fn, params):
        self.fn, self.params = fn, params

    def __call__(self, tensors: tuple) -> None:
        self.fn((ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors]), self.params)


class FlexBackwardKernel:
    """A flex_attention_backward call's Triton kernels (delta; dq; dk and dv, or dk, dv and an atomic dq
    then its conversion: `atomic_dq`), called with the op's own arguments; returns dq, dk, dv and None for
    each captured tensor (none needs a gradient)."""

    fresh_result = True

    def __init__(self, spec: FlexBackwardSpec, target: Target):
        self.spec = spec
        self.launches = list(backward_launches(spec.forward, target))
        self.plans: dict[tuple, BackwardPlan] = {}  # by the operands' sizes, strides and dtypes
        self.__name__ = "flex_attention_backward_kernel"
        self.atomic_dq = atomic_dq(spec.forward)
        self.source = render_flex_triton_bwd(spec, target.interpreted)
        module = _load_flex(self.source, "ember_flex_bwd")
        self.dq_fn, self.dkdv_fn, self.delta_fn, self.convert_fn = (
            DirectLaunch(fn, target.interpreted)
            for fn in (module.flex_bwd_dq, module.flex_bwd_dkdv, module.flex_bwd_delta, module.flex_bwd_dq_convert)
        )

    def __call__(self, q, k, v, out, lse, dout, _dlse, _fw, _joint, block_mask, _scale, _options, sbufs, mbufs):
        masks = block_mask[2:10]  # kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx
        blocks = (int(block_mask[-3]), int(block_mask[-2]))
        operands = (q, k, v, out, lse, dout, *masks, *sbufs, *mbufs)
        key = (blocks, q.device, *[None if t is None else (t.shape, t.stride(), t.dtype) for t in operands])
        plan = self.plans.get(key)
        made = plan is None
        if made:
            plan = _kept(self.plans, key, self._plan(blocks, operands, len(masks)))
        empty = plan.empty
        dq, dk, dv = empty(*plan.dq), empty(*plan.dk), empty(*plan.dv)
        nones = (None,) * len(sbufs)
        if plan.dkdv_launch is None:  # no queries or no keys
            return (dq.zero_(), dk.zero_(), dv.zero_(), *nones)
        if plan.lse_converted:
            lse = lse.to(self.spec.forward.work_dtype).contiguous()
        delta = empty(*plan.delta)
        kept = masks if self.spec.forward.has_full_blocks else (masks[0], masks[1], masks[4], masks[5])
        if plan.dq_launch is None:  # dq added up atomically by the dk/dv kernel, then converted
            dqa = empty(*plan.dq_accumulator)
            plan.delta_launch((out, dout, delta, dqa))
            plan.dkdv_launch((q, k, v, dout, lse, delta, dqa, dk, dv, *kept, *sbufs, *mbufs))
            plan.convert_launch((dqa, dq))
        else:
            plan.delta_launch((out, dout, delta, delta))  # (no accumulator to zero)
            tensors = (q, k, v, dout, lse, delta, dq, dk, dv, *kept, *sbufs, *mbufs)
            ptrs = [t.data_ptr() for t in tensors]  # both kernels take the same tensors
            plan.dq_launch(tensors, ptrs)
            plan.dkdv_launch(tensors, ptrs)
        if made:  # fewer stages where shared memory ran out: the next plans' start
            self.launches = [plan.dq_launch.launch if plan.dq_launch else self.launches[0], plan.dkdv_launch.launch]
        return (dq, dk, dv, *nones)

    def _plan(self, blocks: tuple[int, int], operands: tuple, masks: int) -> BackwardPlan:
        """What a call with these operands' sizes and strides launches, worked out once: the gradients' and
        delta's layouts, then the delta, dq and dk/dv kernels' parameters, grids and constants."""
        fwd = self.spec.forward
        q, k, v, out, lse, dout = operands[:6]
        kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = operands[6 : 6 + masks]
        buffers = operands[6 + masks :]
        B, H, M, _ = q.shape
        N = k.shape[2]
        grads = [(*_like_query(t, d), t.dtype) for t, d in ((q, fwd.head_dim), (k, fwd.head_dim), (v, fwd.value_dim))]
        delta = ((B, H, M), (H * M, M, 1), fwd.work_dtype)
        plan = BackwardPlan(allocator(q.device), *grads, delta)
        if q.numel() == 0 or k.numel() == 0:
            return plan
        plan.lse_converted = lse.dtype != fwd.work_dtype or not lse.is_contiguous()
        if self.atomic_dq:  # GQ's place holds the accumulator, [B, H, M, D] contiguous in the work dtype
            accumulator = (B, H, M, fwd.head_dim)
            strides = tuple(int(st) for st in contiguous_strides(accumulator))
            plan.dq_accumulator = (accumulator, strides, fwd.work_dtype)
            grads[0] = (grads[0][0], plan.dq_accumulator[1], grads[0][2])
            plan.convert_launch = self._convert_launch(q.shape, plan.dq[1])
        plan.delta_launch = self._delta_launch(out, dout, zero_dq=self.atomic_dq)
        if not fwd.has_full_blocks:
            full_num, full_idx, full_q_num, full_q_idx = kv_num, kv_idx, q_num, q_idx
        ints = [B, H, M, N, H // k.shape[1], kv_num.shape[0], kv_num.shape[1]]
        for t in (q, k, v, dout):
            ints += t.stride()
        for _, stride, _ in grads:
            ints += stride
        for t in (kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx):
            ints += t.stride()
        buf_ints = [x for buf in buffers for x in (*buf.shape, *buf.stride())]
        _check_index_range(buffers)
        q_block, kv_block = blocks
        launches = []
        for fn, launch in zip((self.dq_fn, self.dkdv_fn), self.launches):
            if fn is self.dq_fn and self.atomic_dq:
                launches.append(None)
                continue
            block_m, block_n, d_pad, dv_pad = block_sizes(fwd, launch, q_block, kv_block)
            consts = {"QB": q_block, "KB": kv_block, "D": fwd.head_dim, "DV": fwd.value_dim}
            consts.update(D_PAD=d_pad, DV_PAD=dv_pad, BLOCK_M=block_m, BLOCK_N=block_n)
            if fn is self.dq_fn:  # a program per BLOCK_M query rows of a query head, walking key blocks
                grid = ((M + block_m - 1) // block_m, B * H)
                walk = steps(kv_block, N, block_n)
                consts.update(EVEN_N=even(kv_block, N, block_n), KV_NESTED=walk >= CONTIGUOUS_STEPS)
            else:  # a program per BLOCK_N keys of a key head, walking query blocks
                grid = ((N + block_n - 1) // block_n, B * k.shape[1])
                walk = steps(q_block, M, block_m)
                consts.update(EVEN_M=even(q_block, M, block_m), Q_NESTED=walk >= CONTIGUOUS_STEPS)
                consts.update(ATOMIC_DQ=self.atomic_dq, EVEN_KEYS=N % block_n == 0)
            launches.append(BoundLaunch(fn, grid, (*ints, *buf_ints, walk), consts, launch))
        plan.dq_launch, plan.dkdv_launch = launches
        return plan

    def _delta_launch(self, out: torch.Tensor, dout: torch.Tensor, zero_dq: bool) -> BoundLaunch:
        """The kernel of rowsum(dout * out) in the work dtype, into a [B, H, M] contiguous delta; with
        `zero_dq`, it also zeroes the atomic dq's accumulator over the same rows."""
        B, H, M, DV = out.shape
        D = self.spec.forward.head_dim
        dv_pad, d_pad = max(16, pow2(DV)), max(16, pow2(D))
        scalars = (*out.stride(), *dout.stride())
        consts = {"DV": DV, "DV_PAD": dv_pad, "D": D, "D_PAD": d_pad, "ZERO_DQ": zero_dq}
        return _row_launch(self.delta_fn, (B, H, M), max(dv_pad, d_pad), scalars, consts)

    def _convert_launch(self, shape: torch.Size, dq_stride: tuple) -> BoundLaunch:
        """The kernel writing the atomic dq's accumulator, scaled and cast, into dq's layout."""
        B, H, M, D = shape
        d_pad = max(16, pow2(D))
        return _row_launch(self.convert_fn, (B, H, M), d_pad, dq_stride, {"D": D, "D_PAD": d_pad})


def _row_launch(fn: DirectLaunch, bhm: tuple, width: int, scalars: tuple, consts: dict) -> BoundLaunch:
    """A launch of one of the backward's row kernels (flex_bwd_rows): BLOCK_R rows of the [B, H, M] walk a
    program, each `width` (a power of two) wide, up to 4,096 elements a program."""
    B, H, M = bhm
    rows = max(1, min(64, 4096 // width))
    grid = ((B * H * M + rows - 1) // rows,)
    launch = FlexLaunch(rows, width, 4, 1)
    return BoundLaunch(fn, grid, (B * H * M, H, M, *scalars), {**consts, "BLOCK_R": rows}, launch)


@dataclass
class BackwardPlan:
    """A flex backward call's work for one set of operand sizes and strides: `empty` and the (size,
    stride, dtype) of dq, dk, dv and delta; whether lse needs converting to the work dtype; the
    launches (dkdv_launch None: no queries or no keys, nothing to compute)."""

    empty: Callable
    dq: tuple
    dk: tuple
    dv: tuple
    delta: tuple
    lse_converted: bool = False
    dq_accumulator: tuple | None = None  # the atomic dq's (size, stride, dtype)
    delta_launch: BoundLaunch | None = None
    dq_launch: BoundLaunch | None = None  # None with dkdv_launch set: dq is added up atomically
    dkdv_launch: BoundLaunch | None = None
    convert_launch: BoundLaunch | None = None


def _check_index_range(buffers) -> None:
    """The kernels index captured tensors in 32 bits (aten/lowerings/flex.py)."""
    for buf in buffers:
        if sum((n - 1) * abs(st) for n, st in zip(buf.shape, buf.stride())) >= 2**31:
            raise RuntimeError(
                f"flex_attention: a captured tensor of shape {tuple(buf.shape)} is too large to index in 32 bits"
            )


def _like_query(q: torch.Tensor, dv: int) -> tuple[tuple, tuple]:
    """The size and stride of out: q's with a head size of `dv`, in the dim order of q's strides (eager's
    `_permute_strides`)."""
    shape = (*q.shape[:3], dv)
    if q.is_contiguous() and min(q.shape[:3]) > 1:  # (a size-1 dim's place in the order is eager's tie-break)
        order = (0, 1, 2, 3)
    else:
        order = sorted(range(4), key=lambda d: (-q.stride(d), -d))  # outermost first
    stride, step = [0] * 4, 1
    for d in reversed(order):
        stride[d], step = step, step * shape[d]
    return shape, tuple(stride)


def _load_flex(body: str, prefix: str):
    from ember.codegen.flex_expr import TRITON_HELPERS

    return load_triton(TRITON_HELPERS + body, prefix)


def _compile_cpp(source: str, target: Target):
    from ember.backends.cpp import PRELUDE_INCLUDES, build_library, vector_math

    declarations, link = vector_math()  # libmvec's vector exp for the `omp simd` loops
    # After the prelude's include lines, so that the source still begins with them (backends/cpp_headers.py).
    source = source.replace(PRELUDE_INCLUDES, PRELUDE_INCLUDES + declarations, 1)
    lib = build_library(source, target, link)
    fn = lib.flex_fwd
    fn.restype = None
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64)]
    fn.lib = lib  # the library stays loaded while the kernel can be called
    return fn


__all__ = [
    "FlexBackwardKernel",
    "FlexKernel",
    "backward_launches",
    "build_flex_kernels",
    "forward_launch",
]
