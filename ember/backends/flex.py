"""FlexAttention's kernels built and called: each `flex_attention` extern of a schedule (its target an
ir/flex.py `FlexAttention`) gets a `FlexKernel`, the compiled flash-attention kernel of its spec for
the Target's code generator (C++ on the CPU, Triton on a GPU or in Triton's interpreter), with the
Target's tiles (`heuristics.flex`). The host program calls it as it calls any extern: it allocates
out, lse and max in the op's layouts, reads sizes and strides from its operands and launches.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
import sys

import torch

from ember import config
from ember.codegen.cpp import PRELUDE
from ember.codegen.flex_cpp import render_flex_cpp
from ember.codegen.flex_triton import FlexLaunch, block_sizes, render_flex_triton
from ember.ir.flex import FlexAttention, FlexSpec
from ember.runtime import scratch
from ember.runtime.cache import DiskCache, content_key
from ember.schedule.steps import ExternStep, Schedule
from ember.target import Target


def build_flex_kernels(sched: Schedule, target: Target) -> int:
    """Give each flex_attention extern of `sched` its kernel; returns how many there were."""
    built = 0
    for step in sched.steps:
        if isinstance(step, ExternStep) and isinstance(step.node.attrs["target"], FlexAttention):
            spec = step.node.attrs["target"].spec
            step.node.attrs["target"] = FlexKernel(spec, target, len(step.node.attrs["output_positions"]))
            built += 1
    return built


def _launch(spec: FlexSpec, target: Target) -> FlexLaunch:
    h = target.heuristics.flex
    if target.name == "cpp":
        tile = h.cpu
    else:
        tile = h.small if spec.head_dim <= 64 else h.medium if spec.head_dim <= 128 else h.large
    return FlexLaunch(tile.xblock, tile.rblock, tile.warps, h.stages)


class FlexKernel:
    """A flex_attention call's compiled kernel, called with the extern's operands."""

    fresh_result = True

    def __init__(self, spec: FlexSpec, target: Target, results: int):
        self.spec, self.results = spec, results
        self.launch = _launch(spec, target)
        self.__name__ = "flex_attention_kernel"  # the host program's name for it
        self.cpp = target.name == "cpp"
        if self.cpp:
            source = PRELUDE + render_flex_cpp(spec, "flex_fwd", self.launch.block_m, self.launch.block_n)
            self.source = source
            self.fn = _compile_cpp(source, target)
        else:
            self.interpreted = target.interpreted
            self.source = render_flex_triton(spec, "flex_fwd", self.launch, target.interpreted)
            self.fn = _load_triton(self.source)

    def __call__(self, q, k, v, kv_num, kv_idx, *rest):
        spec = self.spec
        full = rest[:2] if spec.has_full_blocks else ()
        buffers = rest[2:] if spec.has_full_blocks else rest
        B, H, M, _ = q.shape
        N = k.shape[2]
        out = _like_query(q, spec.value_dim)
        lse = torch.empty((B, H, M), dtype=spec.work_dtype, device=q.device)
        mx = torch.empty((B, H, M), dtype=spec.work_dtype, device=q.device)
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
        tensors = [q, k, v, out, lse, mx, kv_num, kv_idx, *full, *buffers]
        if self.cpp:
            ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
            params = (ctypes.c_int64 * (len(ints) + len(buf_ints)))(*ints, *buf_ints)
            self.fn(ptrs, params)
        else:
            block_m, block_n, d_pad, dv_pad = block_sizes(spec, self.launch)
            grid = ((M + block_m - 1) // block_m, B * H)
            kwargs = {} if self.interpreted else {"num_warps": self.launch.warps, "num_stages": self.launch.stages}
            self.fn[grid](
                *tensors,
                *ints,
                *buf_ints,
                spec.scale,
                QB=spec.q_block,
                KB=spec.kv_block,
                D=spec.head_dim,
                DV=spec.value_dim,
                D_PAD=d_pad,
                DV_PAD=dv_pad,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                **kwargs,
            )
        return (out, lse, mx)[: self.results]


def _like_query(q: torch.Tensor, dv: int) -> torch.Tensor:
    """out in the dim order of q's strides (eager's `_permute_strides`)."""
    shape = (*q.shape[:3], dv)
    order = sorted(range(4), key=lambda d: (-q.stride(d), -d))  # outermost first
    dense = torch.empty([shape[d] for d in order], dtype=q.dtype, device=q.device)
    inverse = [order.index(d) for d in range(4)]
    return dense.permute(inverse)


def _compile_cpp(source: str, target: Target):
    from ember.backends.cpp import FLAGS, ToolchainError, load_library, toolchain_identity

    cxx = config.get("cxx")
    key = content_key("cpp", source, target=target.key(), toolchain=(toolchain_identity(cxx), FLAGS))
    cache = DiskCache()
    hit = cache.get("cpp", key)
    if hit is not None:
        lib = load_library(scratch.private_copy(hit["graph.so"], "graph.so"))
    else:
        build = scratch.build_folder("cpp")
        try:
            src, out = build / "flex.cpp", build / "flex.so"
            src.write_text(source)
            try:
                proc = subprocess.run(
                    [cxx, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, timeout=600, check=False
                )
            except (OSError, subprocess.SubprocessError) as e:
                raise ToolchainError(f"{cxx} failed to run: {e}") from None
            if proc.returncode != 0:
                raise ToolchainError(f"{cxx} exited {proc.returncode}: {proc.stderr.strip()[:2000]}")
            library = out.read_bytes()
            if sys.platform.startswith("linux") and not library.startswith(b"\x7fELF"):
                raise ToolchainError(f"{cxx} exited 0 but wrote no shared library")
            cache.put("cpp", key, {"graph.cpp": source.encode(), "graph.so": library})
            lib = load_library(out)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    fn = lib.flex_fwd
    fn.restype = None
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64)]
    fn.lib = lib  # the library stays loaded while the kernel can be called
    return fn


def _load_triton(body: str):
    from ember.codegen.flex_expr import TRITON_HELPERS
    from ember.codegen.triton import PRELUDE as TRITON_PRELUDE
    from ember.runtime.cache import triton_identity

    source = TRITON_PRELUDE + TRITON_HELPERS + body
    key = content_key("triton", source, toolchain=triton_identity())
    cache = DiskCache()
    entry = cache.get("triton", key) or cache.put("triton", key, {"kernels.py": source.encode()})
    name = f"ember_flex_{key[:16]}"
    module = sys.modules.get(name)
    if module is None:
        # Imported from a private copy of the checked bytes: Triton reads the kernel's source back.
        path = scratch.private_copy(entry["kernels.py"], f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module.flex_fwd


__all__ = ["FlexKernel", "build_flex_kernels"]
