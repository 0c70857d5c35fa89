"""Process-wide counters of what ember's compiles did: kernels compiled, kernels shared, cache imports.

A leaf anyone may import. Counters only ever grow; `snapshot()` returns a copy and `delta(before)`
what changed since one, which is how tests and `ember bench --compile-time` read them:

    before = ember.stats.snapshot()
    ... compile ...
    ember.stats.delta(before)["kernel_dedup_hits"]

Names in use:
    kernels_compiled          distinct Triton kernels this process compiled (or, under Triton's
                              interpreter, loaded), one per normalized source and specialization
    kernel_dedup_hits         kernels that took an already compiled one's binary in this process
                              (another layer, another graph, the forward's kernel in the backward)
    kernel_dedup_disk_hits    kernels loaded from the launch record another module left in the
                              disk cache, without compiling
    cpp_builds                C++ libraries built (a library found in the disk cache is not)
    address_tables_built      table combo kernels' address tables made outside CUDA graphs (one per
                              new set of addresses: backends/table_launch.py)
    build_*_s                 wall seconds of the Triton backend's build parts (render, the module's
                              file in the cache, GEMM templates, loads from launch records, kernel
                              keys and compile)
    kernel_modules_imported   graphs' Triton kernel modules imported (backends/kernel_module.py: only
                              where a kernel's function is used)
    triton_<stage>_s          seconds Triton's stages took (front end, ttir, ttgir, llir, ptx,
                              cubin = ptxas), summed over threads and compile workers; filled only
                              where a compile listener is installed (`listen_to_triton`)
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_counts: Counter = Counter()


def add(name: str, value: float = 1) -> None:
    with _lock:
        _counts[name] += value


def get(name: str) -> float:
    with _lock:
        return _counts[name]


def snapshot() -> dict[str, float]:
    with _lock:
        return dict(_counts)


def delta(before: dict[str, float]) -> dict[str, float]:
    """What each counter gained since `before` (a snapshot); counters that did not change are left out."""
    now = snapshot()
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def add_triton_times(times) -> None:
    """Count one compile's stage times, as Triton's compilation listener reports them
    (`CompileTimes`: microseconds of IR initialization, the front end, and per lowering stage)."""
    add("triton_front_end_s", times.ir_initialization / 1e6)
    for stage, us in times.lowering_stages:
        add(f"triton_{stage}_s", us / 1e6)


def listen_to_triton() -> bool:
    """Install a Triton compilation listener that counts each stage's time (Triton's `knobs`, where
    this Triton has them); an existing listener keeps being called. Returns whether one is installed.
    Off by default: the listener is process-wide and ember's compiles do not need it."""
    try:
        from triton import knobs
    except ImportError:
        return False
    compilation = getattr(knobs, "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        return False
    previous = compilation.listener
    if getattr(previous, "_ember_stats", False):
        return True

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:
            add_triton_times(times)
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    listener._ember_stats = True
    compilation.listener = listener
    return True
