"""Compiled Triton kernels loaded into torch's static CUDA launcher, and the records that let a
warm start load them again without Triton.

`from_compiled` loads a kernel Triton just compiled (or found in its cache). A warm start used to
go through Triton for every kernel: its `warmup` parses and hashes the kernel's source (its front
end, under the GIL) only to find the binary in its own disk cache, about 4.6 s for ResNet-50's 478
training kernels on the H100 host. What the static launcher needs is small: the
cubin, its symbol name, shared memory, warps and the argument codes. `LaunchRecords` keeps that
per module and specialization in ember's cache; `from_record` loads a kernel from it directly.
A cubin is loaded from a private copy of the bytes the cache checked, never from the cache's file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from ember import log
from ember.runtime import scratch
from ember.runtime.cache import DiskCache, content_key, triton_identity

# Triton's scalar types -> _StaticCudaLauncher's argument codes (pointers are "O").
_STATIC_TYPES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u32": "I", "u64": "K", "fp32": "f"}


@dataclass(frozen=True)
class StaticLaunch:
    """A compiled kernel loaded through torch's static CUDA launcher."""

    launch: Callable  # torch._C._StaticCudaLauncher._launch_kernel
    function: int  # the CUfunction handle
    num_warps: int
    shared: int
    params: tuple[str | None, ...]  # per Triton parameter: its argument code, None for a constexpr
    scratch: int  # trailing scratch-pointer arguments the binary takes (null: sized 0)
    record: dict  # what from_record needs to load it again (the cubin by its cache key)

    @cached_property
    def codes(self) -> str:
        """The launcher's argument codes: the non-constexpr parameters', then the scratch pointers'."""
        return "".join(c for c in self.params if c) + "O" * self.scratch

    def line(self, blocks: int, args: list[str]) -> str:
        """The launch statement, given every parameter's Python expression in order. Pointers go
        as integer addresses: the launcher then skips its per-pointer driver query."""
        passed = [f"{a}.data_ptr()" if code == "O" else a for a, code in zip(args, self.params, strict=True) if code]
        passed += ["None"] * self.scratch
        return (
            f"_static_launch({self.function}, {blocks}, 1, 1, {self.num_warps}, {self.shared}, "
            f"{self.codes!r}, ({', '.join(passed)},), stream)"
        )

    def run(self, blocks: int, args: tuple, stream: int) -> None:
        """Launch now, given every non-constexpr parameter's value in order (pointers as addresses)."""
        scratch = (None,) * self.scratch
        self.launch(self.function, blocks, 1, 1, self.num_warps, self.shared, self.codes, args + scratch, stream)


def from_compiled(compiled, device: int) -> StaticLaunch | None:
    """Load a compiled kernel through torch's static launcher; None where this torch lacks it or
    the kernel needs what it does not do (then Triton's own launcher runs it)."""
    md = compiled.metadata
    if _launcher() is None or getattr(md, "num_ctas", 1) != 1 or launch_hooks():
        return None
    if getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        return None
    scratch = [f for f in ("global_scratch_size", "profile_scratch_size") if hasattr(md, f)]
    if any(getattr(md, f) for f in scratch):
        return None
    params: list[str | None] = []
    for ty in compiled.src.signature.values():
        ty = str(ty)
        code = None if ty == "constexpr" else "O" if ty.startswith("*") else _STATIC_TYPES.get(ty)
        if code is None and ty != "constexpr":
            return None
        params.append(code)
    cubin = compiled.asm.get("cubin")
    if not cubin:
        return None
    # A launch record names the binary by its content: it goes into ember's cache.
    cubin_key = content_key("cubin", cubin)
    DiskCache().put("cubin", cubin_key, {"kernel.cubin": cubin})
    record = {
        "cubin": cubin_key,
        "name": md.name,
        "shared": md.shared,
        "num_warps": md.num_warps,
        "params": params,
        "scratch": len(scratch),
    }
    return _load(cubin, record, device)


def from_record(record: dict, device: int) -> StaticLaunch | None:
    """Load a kernel from its launch record; None where its cubin is gone from ember's cache or the
    launcher cannot be used now."""
    if _launcher() is None or launch_hooks():
        return None
    try:
        entry = DiskCache().get("cubin", record["cubin"])
        return None if entry is None else _load(entry["kernel.cubin"], record, device)
    except (KeyError, TypeError, RuntimeError) as e:  # a malformed record or a binary the driver refuses
        log.artifact("cache", "launch record", f"not loaded ({type(e).__name__}: {e})"[:300])
        return None


def _load(cubin: bytes, record: dict, device: int) -> StaticLaunch:
    """Load `cubin` (as built, or as the cache checked it). The launcher reads a file: a private
    copy of these bytes (runtime/scratch.py), removed once loaded."""
    launcher = _launcher()
    path = scratch.private_copy(cubin, "kernel.cubin")
    try:
        loaded = launcher._load_kernel(str(path), record["name"], record["shared"], device)
    finally:
        path.unlink(missing_ok=True)
    # torch 2.11 returns (function, registers, spills); later ones put the module first.
    function = loaded[0] if len(loaded) == 3 else loaded[1]
    return StaticLaunch(
        launcher._launch_kernel,
        int(function),
        record["num_warps"],
        record["shared"],
        tuple(record["params"]),
        record["scratch"],
        record,
    )


def _launcher():
    return getattr(torch._C, "_StaticCudaLauncher", None)


def launch_hooks() -> bool:
    """Whether Triton has launch hooks set (its profiler): only its own launcher calls them."""
    try:
        from triton import knobs

        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):
        return True
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class LaunchRecords:
    """The launch records of one kernel module's statically launched kernels, in ember's cache.

    The key (runtime/cache.py) holds everything that picks the binary Triton would compile and how
    it is launched: the module's source (its content key), each kernel's warm-up arguments,
    constants, warps and contraction (their specialization), the target's key (ember/target.py,
    which holds the GPU's Triton target), Triton's identity (its version and the environment that
    steers its passes), and ember's, which holds this module's reading of the binary (argument
    codes, what the launcher can run) and torch's version (its launcher). A record whose cubin is
    gone is simply compiled again."""

    def __init__(self, module_key: str, jobs: list[tuple], target: tuple):
        self.key = content_key("launch", module_key, jobs, target=target, toolchain=triton_identity(), ember=True)

    def load(self) -> dict[str, dict]:
        entry = DiskCache().get("launch", self.key)
        if entry is None:
            return {}
        try:
            return json.loads(entry["records.json"])
        except (KeyError, ValueError):
            return {}

    def save(self, records: dict[str, dict]) -> None:
        DiskCache().put("launch", self.key, {"records.json": json.dumps(records, sort_keys=True).encode()})
