"""FlexAttention's kernels built and called: each `flex_attention` extern of a schedule (its target an
ir/flex.py `FlexAttention`) gets a `FlexKernel`, the compiled flash-attention kernel of its spec for
the Target's code generator (C++ on the CPU, Triton on a GPU or in Triton's interpreter), with the
Target's tiles (`heuristics.flex`). The host program calls it as it calls any extern: it allocates
out, lse and max in the op's layouts, reads sizes and strides from its operands and launches.
"""

from __future__ import annotations

import ctypes

import torch

from ember import log
from ember.backends.direct_launch import DirectLaunch, allocator, launch_fitting, load_triton
from ember.codegen.cpp import PRELUDE
from ember.codegen.flex_cpp import render_flex_cpp
from ember.codegen.flex_triton import CONTIGUOUS_STEPS, FlexLaunch, block_sizes, even, pow2, render_flex_triton, steps
from ember.codegen.flex_triton_bwd import render_flex_triton_bwd
from ember.ir.flex import FlexAttention, FlexAttentionBackward, FlexBackwardSpec, FlexSpec
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
        q_block, kv_block = (spec.q_block, spec.kv_block) if spec.q_block else (int(rest[-2]), int(rest[-1]))
        rest = rest if spec.q_block else rest[:-2]
        full = rest[:2] if spec.has_full_blocks else ()
        buffers = rest[2:] if spec.has_full_blocks else rest
        B, H, M, _ = q.shape
        N = k.shape[2]
        empty = allocator(q.device)
        out = _like_query(q, spec.value_dim, empty)
        lse = empty((B, H, M), (H * M, M, 1), spec.work_dtype)
        mx = empty((B, H, M), (H * M, M, 1), spec.work_dtype)
        if B == 0 or H == 0 or M == 0:
            return (out, lse, mx)[: self.results]
        # A key/value batch of 1 serves every query batch (eager broadcasts it).
        kb_stride = 0 if k.shape[0] == 1 and B > 1 else k.stride(0)
        vb_stride = 0 if v.shape[0] == 1 and B > 1 else v.stride(0)
        full_num, full_idx = full if full else (kv_num, kv_idx)
        ints = [B, H, M, N, H // k.shape[1], kv_num.shape[0], kv_num.shape[1]]
        ints += [*q.stride(), kb_stride, *k.stride()[1:], vb_stride, *v.stride()[1:], *out.stride()]
        ints += [*kv_num.stride(), *kv_idx.stride(), *full_num.stride(), *full_idx.stride()]
        buf_ints = [x for buf in buffers for x in (*buf.shape, *buf.stride())]
        _check_index_range(buffers)
        tensors = [q, k, v, out, lse, mx, kv_num, kv_idx, *full, *buffers]
        if self.cpp:
            ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
            params = (ctypes.c_int64 * (len(ints) + 2 + len(buf_ints)))(*ints, q_block, kv_block, *buf_ints)
            self.fn(ptrs, params)
        else:
            block_m, block_n, d_pad, dv_pad = block_sizes(spec, self.launch, q_block, kv_block)
            grid = ((M + block_m - 1) // block_m, B * H)
            consts = {
                "QB": q_block,
                "KB": kv_block,
                "D": spec.head_dim,
                "DV": spec.value_dim,
                "D_PAD": d_pad,
                "DV_PAD": dv_pad,
            }
            kv_steps = steps(kv_block, N, block_n)
            consts.update(
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                EVEN_N=even(kv_block, N, block_n),
                KV_NESTED=kv_steps >= CONTIGUOUS_STEPS,
            )
            scalars = (*ints, *buf_ints, kv_steps)
            self.launch = launch_fitting(self.fn, grid, tuple(tensors), scalars, consts, self.launch)
        return (out, lse, mx)[: self.results]


class FlexBackwardKernel:
    """A flex_attention_backward call's two Triton kernels (dq; dk and dv), called with the op's own
    arguments; returns dq, dk, dv and None for each captured tensor (none needs a gradient)."""

    fresh_result = True

    def __init__(self, spec: FlexBackwardSpec, target: Target):
        self.spec = spec
        self.launches = list(backward_launches(spec.forward, target))
        self.__name__ = "flex_attention_backward_kernel"
        self.source = render_flex_triton_bwd(spec, target.interpreted)
        module = _load_flex(self.source, "ember_flex_bwd")
        self.dq_fn, self.dkdv_fn, self.delta_fn = (
            DirectLaunch(fn, target.interpreted)
            for fn in (module.flex_bwd_dq, module.flex_bwd_dkdv, module.flex_bwd_delta)
        )

    def _delta(self, out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
        """rowsum(dout * out) in the work dtype, [B, H, M] contiguous."""
        B, H, M, DV = out.shape
        delta = allocator(out.device)((B, H, M), (H * M, M, 1), self.spec.forward.work_dtype)
        dv_pad = max(16, pow2(DV))
        rows = max(1, min(64, 4096 // dv_pad))
        grid = ((B * H * M + rows - 1) // rows,)
        tensors, scalars = (out, dout, delta), (B * H * M, H, M, *out.stride(), *dout.stride())
        consts = {"DV": DV, "DV_PAD": dv_pad, "BLOCK_R": rows}
        self.delta_fn(grid, tensors, scalars, consts, 4, 1)
        return delta

    def __call__(self, q, k, v, out, lse, dout, _dlse, _fw, _joint, block_mask, _scale, _options, sbufs, mbufs):
        fwd = self.spec.forward
        kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = block_mask[2:10]
        B, H, M, _ = q.shape
        N = k.shape[2]
        empty = allocator(q.device)
        dq, dk, dv = (_like_query(t, d, empty) for t, d in ((q, fwd.head_dim), (k, fwd.head_dim), (v, fwd.value_dim)))
        nones = (None,) * len(sbufs)
        if q.numel() == 0 or k.numel() == 0:
            return (dq.zero_(), dk.zero_(), dv.zero_(), *nones)
        lse = lse.to(fwd.work_dtype).contiguous()
        delta = self._delta(out, dout)
        if not fwd.has_full_blocks:
            full_num, full_idx, full_q_num, full_q_idx = kv_num, kv_idx, q_num, q_idx
        ints = [B, H, M, N, H // k.shape[1], kv_num.shape[0], kv_num.shape[1]]
        for t in (q, k, v, dout, dq, dk, dv, kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx):
            ints += t.stride()
        buffers = (*sbufs, *mbufs)
        buf_ints = [x for buf in buffers for x in (*buf.shape, *buf.stride())]
        _check_index_range(buffers)
        blocks = (kv_num, kv_idx, *((full_num, full_idx) if fwd.has_full_blocks else ()))
        blocks += (q_num, q_idx, *((full_q_num, full_q_idx) if fwd.has_full_blocks else ()))
        tensors = [q, k, v, dout, lse, delta, dq, dk, dv, *blocks, *buffers]
        q_block, kv_block = int(block_mask[-3]), int(block_mask[-2])
        for i, (fn, launch) in enumerate(zip((self.dq_fn, self.dkdv_fn), self.launches)):
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
            scalars = (*ints, *buf_ints, walk)
            self.launches[i] = launch_fitting(fn, grid, tuple(tensors), scalars, consts, launch)
        return (dq, dk, dv, *nones)


def _check_index_range(buffers) -> None:
    """The kernels index captured tensors in 32 bits (aten/lowerings/flex.py)."""
    for buf in buffers:
        if sum((n - 1) * abs(st) for n, st in zip(buf.shape, buf.stride())) >= 2**31:
            raise RuntimeError(
                f"flex_attention: a captured tensor of shape {tuple(buf.shape)} is too large to index in 32 bits"
            )


def _like_query(q: torch.Tensor, dv: int, empty) -> torch.Tensor:
    """out in the dim order of q's strides (eager's `_permute_strides`), allocated by `empty`."""
    shape = (*q.shape[:3], dv)
    if q.is_contiguous() and min(q.shape[:3]) > 1:  # (a size-1 dim's place in the order is eager's tie-break)
        order = (0, 1, 2, 3)
    else:
        order = sorted(range(4), key=lambda d: (-q.stride(d), -d))  # outermost first
    stride, step = [0] * 4, 1
    for d in reversed(order):
        stride[d], step = step, step * shape[d]
    return empty(shape, tuple(stride), q.dtype)


def _load_flex(body: str, prefix: str):
    from ember.codegen.flex_expr import TRITON_HELPERS

    return load_triton(TRITON_HELPERS + body, prefix)


def _compile_cpp(source: str, target: Target):
    from ember.backends.cpp import build_library, vector_math

    declarations, link = vector_math()  # libmvec's vector exp for the `omp simd` loops
    source = source.replace("#include <cstring>\n", "#include <cstring>\n" + declarations, 1)
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
