"""glibc's heap kept faulted in between calls of a CPU graph (setting `cpu_heap_retain_mb`).

A compiled CPU graph's buffers, ember's own and those ATen's operators allocate for themselves
(oneDNN's convolution outputs, say), are freed when a call ends and allocated again by the next.
By default glibc's malloc gives that memory back to the kernel in between, two ways:

- a chunk above the mmap threshold is a fresh `mmap`; the threshold starts at 128 KiB and only
  rises to the largest mmapped chunk freed so far;
- when the free memory at the top of the heap exceeds the trim threshold (twice the mmap
  threshold), the heap is shrunk.

Either way the next call's first write to each 4 KiB page faults, and the kernel zeroes the page.
At batch 1 this is most of a convolutional net's time outside its kernels: on the 2-core CPU
machine a 1x1 convolution from 16 to 96 channels over 112x112 took 1.35 ms a call through oneDNN,
0.30 ms with the heap kept, and MobileNetV2's whole inference call went from 13-14 ms to 7-8.

So, once a CPU graph is compiled, ember fixes both thresholds with `mallopt`: chunks below 32 MiB
come from the heap (larger ones stay mmapped, where huge_pages.py applies), and the heap is shrunk
only when more than `cpu_heap_retain_mb` of it is free. The cost is memory: up to that much freed
memory stays with each of malloc's arenas (one per thread that allocated, up to glibc's limit), as
ONNX Runtime's arena keeps its own. The setting is the process's
and outlives the graph: other code in the process (eager PyTorch, other compilers) runs with it too.
Where the user chose glibc's thresholds (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_,
GLIBC_TUNABLES) or another allocator replaces malloc, ember leaves it alone.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

from ember import log

MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold on 64-bit
_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
_REPLACEMENTS = ("jemalloc", "tcmalloc", "mimalloc")  # preloaded allocators that serve malloc instead


def _glibc():
    """The process's C library where it is glibc's (it has `mallopt` and `gnu_get_libc_version`)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (musl and others have no such symbol)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def configure(mallopt, megabytes: int, environ) -> bool:
    """Fix the thresholds through `mallopt` (glibc's, or None where there is none) unless `megabytes` is 0
    or `environ` shows the user's own choice; whether they were set."""
    if mallopt is None or megabytes <= 0 or any(k in environ for k in _USER_SETTINGS):
        return False
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return False
    if any(name in environ.get("LD_PRELOAD", "") for name in _REPLACEMENTS):
        return False
    trim = min(megabytes << 20, 2**31 - 1)  # mallopt takes an int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, trim))
    log.summary(
        f"glibc malloc kept for CPU graphs: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold "
        f"{trim >> 20} MiB" + ("" if done else " (mallopt refused)")
    )
    return done


_decided: list[tuple[int, bool]] = []  # the setting this process decided with, and whether malloc was set
_told: set[int] = set()  # later values already said to change nothing
_lock = threading.Lock()


def retain(megabytes: int) -> bool:
    """`configure` this process's malloc on the first call; later calls, with any value, change nothing
    (a different value is said once, at EMBER_DEBUG=1)."""
    with _lock:
        if not _decided:
            _decided.append((megabytes, configure(_glibc(), megabytes, os.environ)))
        first, outcome = _decided[0]
        if megabytes != first and megabytes not in _told:
            _told.add(megabytes)
            log.summary(
                f"cpu_heap_retain_mb={megabytes} changes nothing: the process's first CPU graph set malloc with {first}"
            )
        return outcome
