"""Hand-written Triton kernels (FlexAttention's, the grouped skinny products') loaded and launched
from the host program with little Python per call: `load_triton` imports a kernel source through
ember's disk cache, `DirectLaunch` launches a compiled binary without `kernel[grid]`'s argument
binding, and `allocator` is the host program's `empty` for such kernels' results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from ember import log
from ember.runtime import scratch
from ember.runtime.cache import DiskCache, content_key


class DirectLaunch:
    """A hand-written Triton kernel launched through a compiled launcher. `kernel[grid]` binds and
    specializes every argument in Python on each call (a flex kernel takes about a hundred: tensors, sizes,
    strides), which made short sparse-mask steps host-bound. The first call with a given specialization goes through
    `kernel[grid]` (which compiles); later calls with the same one launch the compiled binary, through
    torch's static launcher where it takes the kernel (the C++ one Inductor uses), else Triton's own.
    The key is what Triton specializes on: each tensor's 16-byte alignment, each integer's equality to
    1, divisibility by 16 and 32-bit range (not its value: sizes that vary under dynamic shapes share a
    binary), the constants, warps and stages, and the device. In Triton's interpreter every call is
    `kernel[grid]` (it takes no warps or stages)."""

    def __init__(self, fn, interpreted: bool):
        from ember.backends.triton import current_stream

        self.fn, self.interpreted, self.stream = fn, interpreted, current_stream
        self.names = list(fn.arg_names)
        self.compiled: dict[tuple, tuple] = {}  # Triton's specialization -> launcher
        # The same launchers by the arguments' values: a step calls with the same sizes and strides
        # each time, and one tuple lookup costs less than specializing a hundred integers.
        self.by_value: dict[tuple, tuple] = {}

    def __call__(self, grid: tuple, tensors: tuple, scalars: tuple, consts: dict, warps: int, stages: int) -> None:
        """Launch over `grid` with the kernel's tensor parameters, then its other ones, in order."""
        if self.interpreted:
            self.fn[grid](*tensors, *scalars, **consts)
            return
        device = tensors[0].device.index or 0
        ptrs = [t.data_ptr() for t in tensors]
        aligned = tuple((p & 15) == 0 for p in ptrs)
        hit, key = self._find(device, aligned, scalars, consts, warps, stages)
        if hit is None or hit[0] == "jit":
            on_device = torch.cuda.device(device) if tensors[0].is_cuda else contextlib.nullcontext()
            with on_device:  # Triton compiles for, and launches on, the current device
                compiled = self.fn[grid](*tensors, *scalars, **consts, num_warps=warps, num_stages=stages)
            if hit is None:  # the first call of this specialization compiled it: its launcher is kept
                self.compiled[key] = self._launcher(compiled, device, len(tensors), scalars, consts)
            return
        _launch(hit, grid, self.stream(device), ptrs, tensors, scalars)

    def launcher(self, device: int, aligned: tuple, scalars: tuple, consts: dict, warps: int, stages: int):
        """The launcher compiled for these arguments' specialization (see _launcher), or None before the first
        call with it."""
        return self._find(device, aligned, scalars, consts, warps, stages)[0]

    def _find(self, device: int, aligned: tuple, scalars: tuple, consts: dict, warps: int, stages: int):
        """(launcher or None, Triton's specialization key or None where the arguments' values found it)."""
        # With the scalars' types: 1, True and 1.0 are one dict key, but Triton specializes them apart.
        exact = (device, aligned, scalars, tuple(map(type, scalars)), tuple(consts.values()), warps, stages)
        hit = self.by_value.get(exact)
        if hit is not None:
            return hit, None
        key = (device, aligned, tuple(map(_specialized, scalars)), exact[4], warps, stages)
        hit = self.compiled.get(key)
        if hit is not None and hit[0] != "jit":
            if len(self.by_value) >= _BY_VALUE_LIMIT:
                self.by_value.clear()
            self.by_value[exact] = hit
        return hit, key

    def _launcher(self, compiled, device: int, tensors: int, scalars: tuple, consts: dict) -> tuple:
        """How to launch `compiled` again: torch's static launcher where it can (a few microseconds
        for a hundred arguments), else Triton's own launcher, else ("jit",): `kernel[grid]` each call
        (also where loading the binary into a launcher failed)."""
        from ember.backends import static_launch
        from ember.backends.triton import launch_handles

        try:
            st = static_launch.from_compiled(compiled, device)
            if st is not None and all(code == "O" for code in st.params[:tensors]):
                # The scalars Triton did not make constants (an integer equal to 1 is one), in order.
                kept = [i for i, code in enumerate(st.params[tensors : tensors + len(scalars)]) if code]
                codes = "".join(c for c in st.params if c) + "O" * st.scratch
                return ("static", st, codes, kept)
            handles = launch_handles(compiled)
        except Exception as e:  # noqa: BLE001 - a launcher that cannot load the binary: kernel[grid] still can
            log.summary(
                f"{getattr(self.fn, '__name__', 'kernel')}: launched through kernel[grid] ({type(e).__name__}: {e})"
            )
            return ("jit",)
        if handles is None:
            return ("jit",)
        tail = tuple(consts[name] for name in self.names[tensors + len(scalars) :])
        return ("triton", *handles, tail)


_BY_VALUE_LIMIT = 256  # distinct argument values remembered per kernel (dynamic sizes add one each)


def _launch(hit: tuple, grid: tuple, stream: int, ptrs: list, tensors: tuple, scalars: tuple) -> None:
    """Launch through a launcher of DirectLaunch._launcher ("static" or "triton")."""
    gx, gy, gz = (*grid, 1, 1)[:3]
    if hit[0] == "static":
        _, st, codes, kept = hit
        passed = (*ptrs, *[scalars[i] for i in kept], *([None] * st.scratch))
        st.launch(st.function, gx, gy, gz, st.num_warps, st.shared, codes, passed, stream)
    else:
        _, run, function, meta, tail = hit
        run(gx, gy, gz, stream, function, meta, None, None, None, *tensors, *scalars, *tail)


class BoundLaunch:
    """A DirectLaunch with all but its tensors fixed: the grid, the other parameters, the constants and
    the launch (warps and stages, as launch_fitting settles them). A host program calls a kernel with the
    same sizes and strides at every step (a static graph), so a caller that keeps one per set of them
    launches with the tensors' addresses alone: no key of a hundred integers built and hashed per call.
    The launcher is kept per pointer alignment (Triton specializes on it)."""

    def __init__(self, fn: DirectLaunch, grid: tuple, scalars: tuple, consts: dict, launch):
        self.fn, self.grid, self.scalars, self.consts, self.launch = fn, grid, scalars, consts, launch
        self.ready: dict[tuple, tuple] = {}  # pointer alignment -> ("static" | "triton", ...) launcher

    def __call__(self, tensors: tuple, ptrs: list[int] | None = None) -> None:
        """Launch with `tensors` (their addresses `ptrs`, where a caller launching several kernels over the
        same tensors has them already)."""
        fn = self.fn
        if not fn.interpreted:
            ptrs = ptrs or [t.data_ptr() for t in tensors]
            aligned = tuple((p & 15) == 0 for p in ptrs)
            hit = self.ready.get(aligned)
            if hit is not None:
                _launch(hit, self.grid, fn.stream(tensors[0].device.index or 0), ptrs, tensors, self.scalars)
                return
        self.launch = launch_fitting(fn, self.grid, tensors, self.scalars, self.consts, self.launch)
        if not fn.interpreted:
            device = tensors[0].device.index or 0
            hit = fn.launcher(device, aligned, self.scalars, self.consts, self.launch.warps, self.launch.stages)
            if hit is not None and hit[0] != "jit":
                self.ready[aligned] = hit


def _specialized(x):
    """What Triton's specialization sees of a scalar argument."""
    if isinstance(x, bool) or not isinstance(x, int):
        return x if not isinstance(x, float) else float
    return (x == 1, x % 16 == 0, -(2**31) <= x < 2**31)


def launch_fitting(fn: DirectLaunch, grid, tensors: tuple, scalars: tuple, consts: dict, launch):
    """Launch `fn` with `launch`'s warps and stages (a dataclass with both: a flex tile, a skinny products'
    tile); returns the launch that ran. Where the kernel's shared memory does not fit the device at that
    software-pipelining depth, it is compiled again with one stage fewer, down to none: the pipeliner stages
    every load in the loop (a flex score_mod that gathers from a captured table per score stages a whole tile
    of the table per stage; a GPU may have less shared memory than the one a Target's tile was chosen on)."""
    from triton.runtime.errors import OutOfResources

    while True:
        try:
            fn(grid, tensors, scalars, consts, launch.warps, launch.stages)
            return launch
        except OutOfResources as e:
            if launch.stages <= 1:
                raise
            log.summary(f"{getattr(fn.fn, '__name__', 'kernel')}: {e}; compiled again with {launch.stages - 1} stages")
            launch = dataclasses.replace(launch, stages=launch.stages - 1)


@functools.lru_cache(maxsize=16)
def allocator(device: torch.device):
    """The host program's `empty(size, stride, dtype)` for `device`: torch's C++ helper where it
    can, which skips `torch.empty`'s Python argument parsing (codegen/host.py)."""
    from ember.codegen.host import allocator as host_allocator

    return host_allocator(device)


def load_triton(body: str, prefix: str):
    """The module of Triton source `body` (after codegen/triton.py's prelude), through ember's disk cache:
    one module per distinct source, imported from a private copy."""
    from ember.codegen.triton import PRELUDE as TRITON_PRELUDE
    from ember.runtime.cache import triton_identity

    source = TRITON_PRELUDE + body
    key = content_key("triton", source, toolchain=triton_identity())
    cache = DiskCache()
    entry = cache.get("triton", key) or cache.put("triton", key, {"kernels.py": source.encode()})
    return scratch.import_private_copy(entry["kernels.py"], f"{prefix}_{key[:16]}")


__all__ = ["BoundLaunch", "DirectLaunch", "allocator", "launch_fitting", "load_triton"]
