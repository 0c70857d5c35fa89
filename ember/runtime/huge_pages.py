"""Transparent huge pages for the large CPU buffers a host program allocates.

A CPU buffer of 32 MiB or more is a fresh `mmap` on every call: glibc's malloc never raises its
mmap threshold past `DEFAULT_MMAP_THRESHOLD_MAX` (32 MiB on 64-bit), and torch's CPU allocator is
malloc. Its first write then faults once per 4 KiB page, and the kernel zeroes each one. For
`relu(x) * 0.5 + 1` over 4096² floats that is 16384 faults, about 15 of the 17 ms a call takes on
the 2-core CPU machine, for Inductor and ember alike; the loop itself is about 1.6 ms.

Where the kernel's THP mode is `madvise` (the common distribution default), advising the buffer's
aligned interior `MADV_HUGEPAGE` before the first write makes those faults one per 2 MiB: the same
call takes 5.4 ms (docs/bench/cpu.md). PyTorch offers the same for every allocation behind
`THP_MEM_ALLOC_ENABLE=1`; ember does it by default for its own large buffers only.

Smaller buffers are left alone: they come from malloc's heap, which ember keeps faulted in
between calls (heap.py), and advising pieces of it would only split its mappings. Mode `always`
needs no advice and mode `never` ignores it, so both get the plain allocator. The cost: a fault
that finds no free huge page may compact memory first (the kernel's `defrag` setting), a latency
the `cpu_huge_pages` setting turns off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

MIN_BYTES = 32 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_THP = Path("/sys/kernel/mm/transparent_hugepage")


def thp_mode(root: Path = _THP) -> str:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), or `unsupported`."""
    try:
        text = (root / "enabled").read_text()
    except OSError:
        return "unsupported"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unsupported"


@functools.cache
def _huge_page_bytes() -> int:
    try:
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


@functools.cache
def _madvise() -> Callable | None:
    if not sys.platform.startswith("linux") or thp_mode() != "madvise":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise(t: torch.Tensor, madvise: Callable | None = None, page: int = 0) -> None:
    """Ask for huge pages under the whole aligned pages inside `t`'s storage, before it is written.
    `madvise(start, length, advice)` and the huge page's size: the system's unless given."""
    madvise = madvise or _madvise()
    nbytes = t.untyped_storage().nbytes()
    if madvise is None or nbytes < MIN_BYTES:
        return
    page = page or _huge_page_bytes()
    start = t.untyped_storage().data_ptr()
    lo = -(-start // page) * page
    hi = (start + nbytes) // page * page
    if hi > lo:
        madvise(lo, hi - lo, _MADV_HUGEPAGE)  # a failure only costs the speed-up; nothing to report


def huge_allocator(empty: Callable) -> Callable | None:
    """`empty` followed by `advise`, for buffers of `MIN_BYTES` or more; None where advice cannot help."""
    if _madvise() is None:
        return None

    def empty_huge(size: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
        t = empty(size, stride, dtype)
        advise(t)
        return t

    return empty_huge
