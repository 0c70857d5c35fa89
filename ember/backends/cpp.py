"""CPU backend: all kernels of a graph in one C++ translation unit, one compiler run, one .so.

Stages: render (C++ source) -> compile (g++ -> shared library) -> load (ctypes). The
compiler's identity, the flags and the host CPU (we build with -march=native) enter the
cache key, so a cached library is never loaded on a machine it was not built for.
g++ runs in a folder of the process's private folder (runtime/scratch.py), and a library is
loaded from there too, as the bytes the cache verified; it is unloaded when its compiled graph
is collected.
"""

from __future__ import annotations

import _ctypes
import ctypes
import ctypes.util
import functools
import platform
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import torch

from ember import config, faults, stats
from ember.backends import cpp_headers
from ember.backends.device import device_limits
from ember.codegen.cpp import PRELUDE, render_cpp
from ember.codegen.cpp_combo import render_cpp_combo
from ember.codegen.gemm_cpp import GEMM_PRELUDE, TILE_COLUMNS, TILE_ROWS, render_cpp_gemm
from ember.codegen.render import print_host_index
from ember.runtime import scratch
from ember.runtime.cache import DiskCache, content_key
from ember.schedule.gemm import GemmChoice, GemmProblem, TileConfig, is_gemm_kernel
from ember.schedule.kernel import ComboKernel, Kernel
from ember.schedule.memory import MemoryPlan
from ember.target import CppHeuristics, Heuristics, LowerHeuristics, RealizeHeuristics, Target

PRELUDE_INCLUDES = cpp_headers.include_block(PRELUDE)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-fno-trapping-math"]


def _raising_on_bad_rows(fn, kernel: Kernel):
    """A kernel that reads or writes rows an index tensor names (kernel.KRow) returns whether one was out of
    range (codegen/cpp.py): raise as eager's indexing does, naming the ops."""
    ops = ", ".join(dict.fromkeys(kernel.origins))

    def launch(*args):
        if fn(*args):
            raise IndexError(f"index out of bounds in {kernel.name} ({ops})")

    return launch


class ToolchainError(RuntimeError):
    """The C++ compiler is missing or rejected the generated source."""


@functools.lru_cache(maxsize=4)
def _version_text(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"C++ compiler {cxx!r} is not usable: {e}") from None


def toolchain_identity(cxx: str) -> str:
    out = _version_text(cxx)
    return out.splitlines()[0] if out else cxx


def is_gcc(cxx: str) -> bool:
    """Whether `cxx` is GCC (whatever its name: `c++` names it too), not clang posing as it."""
    text = _version_text(cxx)
    return "Free Software Foundation" in text and "clang" not in text.lower()


# libm functions the C++ renderer calls, with their argument counts.
_VECTOR_MATH = {
    "exp": 1,
    "log": 1,
    "tanh": 1,
    "erf": 1,
    "sin": 1,
    "cos": 1,
    "log1p": 1,
    "expm1": 1,
    "exp2": 1,
    "log2": 1,
    "pow": 2,
}


@functools.lru_cache(maxsize=1)
def vector_math() -> tuple[str, list[str]]:
    """Declarations that let GCC vectorize libm calls in `omp simd` loops, and the link flags.

    glibc's libmvec has SIMD variants of expf, tanhf, ... (what -ffast-math would use); we
    declare them `omp declare simd` ourselves, without fast-math's other licences (NaN and
    infinity stay IEEE). Only functions whose AVX2 and AVX-512 variants this libmvec exports
    are declared; without libmvec (not glibc) nothing is, and the loops call scalar libm.
    """
    path = ctypes.util.find_library("mvec")
    if path is None:
        return "", []
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return "", []
    lines = ['extern "C" {']
    for name, arity in _VECTOR_MATH.items():
        params = ", ".join(["{t}"] * arity)
        for suffix, t in (("f", "float"), ("", "double")):
            lanes = (8, 16) if t == "float" else (4, 8)
            variants = [
                f"_ZGVdN{lanes[0]}{'v' * arity}_{name}{suffix}",
                f"_ZGVeN{lanes[1]}{'v' * arity}_{name}{suffix}",
            ]
            if all(hasattr(lib, v) for v in variants):
                lines += ["#pragma omp declare simd notinbranch", f"{t} {name}{suffix}({params.format(t=t)});"]
    lines.append("}")
    return "\n".join(lines) + "\n", ["-lmvec"]


@functools.lru_cache(maxsize=1)
def _host_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_library(path: Path) -> ctypes.CDLL:
    """Load the shared library at `path` (a file of this process's private folder, removed once
    loaded) and unload it when the returned object is collected. Its functions hold the object,
    so it outlives every call into the library: once a compiled graph is dropped (say by
    `torch._dynamo.reset()`) and collected, its code leaves the process."""
    try:
        lib = ctypes.CDLL(str(path))
    finally:
        path.unlink(missing_ok=True)  # mapped now: the name is no longer needed
    close = getattr(_ctypes, "dlclose", None)
    if close is not None:
        # Not at exit: the process's end unmaps it anyway, and a thread may still be calling in.
        weakref.finalize(lib, close, lib._handle).atexit = False
    return lib


def build_library(source: str, target: Target, link_flags: list[str], cxx: str | None = None) -> ctypes.CDLL:
    """The library of C++ `source`, loaded: from the disk cache, else built (and cached). Either way it
    is loaded from a file of this process's private folder holding the bytes that the cache checked or
    the compiler wrote, so that nothing can swap it between the check and the load. Built with
    -march=native: the library is made for this CPU, which the target's key holds."""
    cxx = cxx or config.get("cxx")
    identity = toolchain_identity(cxx)
    key = content_key("cpp", source, target=target.key(), toolchain=(identity, FLAGS, link_flags))
    cache = DiskCache()
    hit = cache.get("cpp", key)
    if hit is not None:
        return load_library(scratch.private_copy(hit["graph.so"], "graph.so"))
    build = scratch.build_folder("cpp")
    try:
        src = build / "graph.cpp"
        out = build / "graph.so"
        src.write_text(source)
        # The standard headers precompiled, once they are (cpp_headers.py): the same library, built faster.
        header = cpp_headers.flags_for(cxx, FLAGS, PRELUDE_INCLUDES, source, target.arch, identity, is_gcc(cxx))
        stats.add("cpp_builds")
        proc = _run_compiler(cxx, [*FLAGS, *header, str(src), "-o", str(out), *link_flags])
        if header and proc.returncode != 0:
            # Built once more without the header; where that succeeds, the header was what failed (a copy
            # cut short or removed): it is not used again in this process.
            retry = _run_compiler(cxx, [*FLAGS, str(src), "-o", str(out), *link_flags])
            if retry.returncode == 0:
                cpp_headers.forget(header, proc.stderr)
            proc = retry
        elif header and "[-Winvalid-pch]" in proc.stderr:
            cpp_headers.forget(header, proc.stderr)  # refused: g++ parsed the headers instead
        if proc.returncode != 0:
            raise ToolchainError(f"{cxx} exited {proc.returncode}: {proc.stderr.strip()[:2000]}")
        library = out.read_bytes() if out.exists() else b""
        if sys.platform.startswith("linux") and not library.startswith(b"\x7fELF"):
            # Never cache what is not a library: every later compile would load it and fail.
            raise ToolchainError(f"{cxx} exited 0 but wrote no shared library to {out.name}")
        cache.put("cpp", key, {"graph.cpp": source.encode(), "graph.so": library})
        return load_library(out)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _run_compiler(cxx: str, args: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([cxx, *args], capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"{cxx} failed to run: {e}") from None


# The template's register tile, recorded on each product it takes (GemmOp.config).
TEMPLATE_TILE = TileConfig(TILE_ROWS, TILE_COLUMNS, 1, group_m=1, num_stages=1, num_warps=1)


def template_refusal(h: CppHeuristics, m: int, k: int, dtype: torch.dtype = torch.float32) -> str | None:
    """Why a [m, k] x [k, n] product of static sizes is not the C++ GEMM template's (None: it is)."""
    if not h.gemm_template:
        return "cpp.gemm_template is off"
    if dtype != torch.float32:
        return f"{dtype} (the C++ template computes float32)"
    if k > h.gemm_max_k:
        return f"K {k} > cpp.gemm_max_k {h.gemm_max_k}"
    if m * k * 4 > h.gemm_max_a_bytes:
        return f"A of {m * k * 4} bytes > cpp.gemm_max_a_bytes {h.gemm_max_a_bytes}"
    return None


def choose_gemm(h: CppHeuristics, problem: GemmProblem, epilogue_bytes: int) -> GemmChoice:
    """The C++ target's GemmChooser: the template for the 2-d float32 products of static sizes whose A
    has K contiguous, within the Target's bounds (`template_refusal`); ATen's BLAS for the rest."""
    if problem.batched or problem.batch != 1:
        return GemmChoice(False, None, "ATen: a batched product (the C++ template renders 2-d ones)")
    if problem.k == 0:
        return GemmChoice(False, None, "ATen: an empty sum (K = 0)")
    if not problem.static:
        return GemmChoice(False, None, "ATen: sizes known only at run time")
    if problem.a_layout != "row":
        return GemmChoice(False, None, f"ATen: A's layout {problem.a_layout} (the template reads rows of A)")
    refusal = template_refusal(h, problem.m, problem.k, problem.dtype)
    if refusal:
        return GemmChoice(False, None, f"ATen: {refusal}")
    fused = f", {epilogue_bytes} bytes of epilogue round trip saved" if epilogue_bytes else ""
    return GemmChoice(True, TEMPLATE_TILE, f"C++ GEMM template (tile {TILE_ROWS}x{TILE_COLUMNS}{fused})")


def _packed_product_faster(h: CppHeuristics, rows: int, k: int, n: int, bias: bool) -> bool:
    """The C++ target's answer (Target.packed_product_faster): never where ember's template takes the
    product (it stays an `mm` for the scheduler); else measured on this CPU, once per shape."""
    from ember.backends import cpu_products

    if template_refusal(h, rows, k) is None:
        return False
    return cpu_products.packed_is_faster(rows, k, n, bias)


class CppBackend:
    """The Backend (backends/base.py) of the host CPU: C++ with OpenMP loops."""

    name = "cpp"

    def __init__(self):
        self.cxx = config.get("cxx")
        self.sources: dict[str, str] = {}
        self.full_source = ""
        self.lib = None
        limits = device_limits(torch.device("cpu"))
        # The default heuristics: C++ sums columns in loops of its own, neither in row kernels
        # (row_programs 0) nor in one-pass online softmax; a value many readers inline is stored once
        # (its recomputation does not vectorize: realize.py).
        heuristics = Heuristics(
            realize=RealizeHeuristics(shared_readers=4, costly_min_flops=8, free_positions=True),
            lower=LowerHeuristics(
                depthwise_convolutions=True,
                product_convolutions_min_channels=32,
                product_convolutions_max_pixels=16,
                group_frozen_products=True,
                product_bias_as_add=True,
            ),
        ).tuned(config.get("heuristics"))
        self._target = Target(
            "cpp",
            "cpu",
            limits.name,
            arch=(faults.armed("cpu_arch") or _host_cpu(),),  # built with -march=native
            bandwidth=limits.bandwidth,
            flop_rate=limits.flop_rate,
            launch_seconds=limits.launch_seconds,
            indexed_rows=True,  # gathers; its kernels check rows after writing: no row stores, no combos of them
            # No scatter-add in kernels: on 2 cores, torch_geometric's GCN (10k nodes, 50k edges, 64 features)
            # took 30.1 ms with `omp atomic` adds and 14.0 ms with one thread's plain adds, against 12.7 ms
            # with ATen's scatter_add after the fused gather.
            atomic_adds=(),
            heuristics=heuristics,
            packed_product_faster=functools.partial(_packed_product_faster, heuristics.cpp),
        )
        self.gemm_chooser = functools.partial(choose_gemm, heuristics.cpp)

    def target(self) -> Target:
        return self._target

    def build(self, kernels: list[Kernel], memory: MemoryPlan) -> dict[str, object]:
        """Compile all kernels; returns the host-program namespace entries (the callables).
        `memory`: the schedule's memory plan, which says which buffers of a kernel share memory
        (required: without it every pointer would be declared __restrict__)."""
        declarations, self.link_flags = vector_math()
        parts = [PRELUDE, declarations]
        if any(map(is_gemm_kernel, kernels)):
            parts.append(GEMM_PRELUDE)
        self.params = {}
        for k in kernels:
            if is_gemm_kernel(k):
                src, params = render_cpp_gemm(k, self._target, memory.shared_buffers(k))
            elif isinstance(k, ComboKernel):  # independent pointwise kernels in one call
                src, params = render_cpp_combo(k, self._target, memory.shared_buffers)
            else:
                src, params = render_cpp(k, self._target, memory.shared_buffers(k))
            self.sources[k.name] = src
            self.params[k.name] = params
            parts.append(src)
        source = "\n\n".join(parts) + "\n"
        self.full_source = source
        if not kernels:
            return {}
        self.lib = self._compile(source)
        namespace = {}
        for k in kernels:
            fn = getattr(self.lib, k.name)
            checked = isinstance(k, Kernel) and k.checks_rows
            fn.restype = ctypes.c_int64 if checked else None
            fn.argtypes = [ctypes.c_void_p if p.kind == "buffer" else ctypes.c_int64 for p in self.params[k.name]]
            namespace[k.name] = _raising_on_bad_rows(fn, k) if checked else fn
        return namespace

    def _compile(self, source: str) -> ctypes.CDLL:
        return build_library(source, self._target, self.link_flags, self.cxx)

    def prologue(self) -> list[str]:
        return []

    def launch_line(self, kernel: Kernel, args: dict) -> str:
        bufs = iter(args["buffers"])
        parts = []
        for p in self.params[kernel.name]:
            parts.append(f"{next(bufs)}.data_ptr()" if p.kind == "buffer" else print_host_index(p.value))
        return f"{kernel.name}({', '.join(parts)})"
