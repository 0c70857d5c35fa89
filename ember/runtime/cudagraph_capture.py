"""What a capture ember's pool records (runtime/cudagraph_pool.py) offers the launches it runs: the inputs
read through address tables, a place to register the tables the recorded kernels read (backends/table_launch.py),
and memory for them outside the graph pool.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ember import log


def table_span(rows: int) -> int:
    """Rows a table takes in a capture's reserve: its own, rounded up to 16 bytes, so that the next starts
    where a kernel, which takes every pointer as 16-byte aligned, may read it."""
    return rows + (rows & 1)


class RewritableTable(Protocol):
    """An address table a kernel of a recording reads (backends/table_launch.py: CapturedTable):
    written from the host before the first replay, and again whenever an input it points into
    comes at a new address."""

    positions: frozenset[int]  # the inputs it points into

    def write(self, args: list) -> bool:
        """Write the table for this call's inputs; False where the addresses do not suit the kernel
        form the capture recorded (an unaligned buffer for the aligned form): nothing to replay."""


@dataclass
class CaptureScope:
    """What a capture this pool records offers the launches it runs."""

    # The storage (data pointer) of each input the program reaches only through address tables, with
    # (its position, its data pointer at capture): a table pointing into one is rewritten per call.
    table_inputs: dict[int, tuple[int, int]]
    tables: list[RewritableTable] = field(default_factory=list)  # tables the recorded kernels read
    stream: Any = None  # the stream of the call that records (not the capture's); None off CUDA
    # Rows set aside before the capture (Pool._record: the rows of a call's tables), handed out in turn.
    reserve: torch.Tensor | None = None
    reserved: int = 0

    def lasting(self, rows: int, device: torch.device) -> torch.Tensor:
        """Memory for rows a replay reads but no kernel of the graph writes (an address table the host
        writes), outside the graph pool: memory of the graph pool that an earlier recording's
        temporaries use would be written over at each of its replays, and the rows with it. Taken from
        the reserve set aside before the capture; past it (a table launched more than once a call), from
        the caching allocator on the recording call's stream, which asks CUDA for more memory where that
        stream's holds no gap: a thread-local capture refuses that call, and the function then runs
        without its graph, saying so (EMBER_LOGS=cudagraphs)."""
        start = self.reserved
        if self.reserve is not None and start + table_span(rows) <= len(self.reserve):
            self.reserved = start + table_span(rows)
            return self.reserve[start : start + rows]
        if self.stream is None or device.type != "cuda":
            return torch.empty(rows, dtype=torch.int64, device=device)
        with torch.cuda.stream(self.stream):
            return torch.empty(rows, dtype=torch.int64, device=device)


_capture = threading.local()


def capture_scope() -> CaptureScope | None:
    """The scope of the capture a pool records on this thread now; None elsewhere (no capture,
    or a capture of the caller's own, whose replays nothing here sees)."""
    return getattr(_capture, "scope", None)


EXPANDABLE = "expandable_segments:True"
PLAIN = "expandable_segments:False"
_USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # read at start-up, CUDA's first


def _allocator_settings() -> tuple[Callable[[], str], Callable[[str], None]] | None:
    """(get, set) of the CUDA caching allocator's settings string, where this torch can set it. torch 2.13
    reads the string back; where torch cannot (2.11), what the environment said at start-up stands for it."""
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None
    )
    if put is None:
        return None
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is None:

        def get() -> str:
            return next((os.environ[k] for k in _USER_SETTINGS if os.environ.get(k)), "")

    return get, put


def _others(settings: str) -> str:
    """The settings string without its expandable-segments entries (the user's other options, as set)."""
    kept = [o.strip() for o in settings.split(",") if o.strip()]
    return ",".join(o for o in kept if not o.replace(" ", "").lower().startswith("expandable_segments:"))


_toggle_lock = threading.Lock()
_toggle = {"depth": 0, "restore": None}  # captures inside the toggle now; the string to set when the last ends


def _turn_on(get: Callable[[], str], put: Callable[[str], None]) -> tuple[bool, bool]:
    """(whether expandable segments are on for this capture, whether it holds the toggle), under the lock."""
    if _toggle["depth"]:  # another thread's capture turned them on: share it
        _toggle["depth"] += 1
        return True, True
    before = get()
    if EXPANDABLE.lower() in before.replace(" ", "").lower():  # the user's own choice
        return True, False
    if "cudamallocasync" in before.lower():  # CUDA's own allocator serves the pool: nothing to set
        return False, False
    others = _others(before)
    try:
        put(f"{others},{EXPANDABLE}" if others else EXPANDABLE)
    except RuntimeError as e:  # a torch that refuses the string: capture as before
        log.artifact("cudagraphs", "memory pool", f"expandable segments refused ({e}): plain segments")
        return False, False
    # Said outright on the way back: a string that leaves the option out may keep it on.
    _toggle["depth"], _toggle["restore"] = 1, f"{others},{PLAIN}" if others else PLAIN
    return True, True


@contextlib.contextmanager
def expandable_segments(wanted: bool) -> Iterator[bool]:
    """The allocator's expandable segments on while a capture allocates from the graph pool (where `wanted`
    and this torch can set them); yields whether they are on. Without them every request no free block of
    the pool fits maps a new segment, and freed blocks of one segment never merge with another's: a pool
    ends up holding more than the capture ever had live at once. With them the pool is one range that
    grows by mapping pages, and freed neighbours merge. A user's own choice (already on) is left as it is.
    The setting is the process's (other threads allocate with it too meanwhile), so it is on from the first
    of overlapping captures to the last, and the user's other options are set back with it off, whole:
    torch's parser may reset the options a string leaves out."""
    settings = _allocator_settings() if wanted else None
    if settings is None:
        yield False
        return
    get, put = settings
    with _toggle_lock:
        on, holds = _turn_on(get, put)
    try:
        yield on
    finally:
        if holds:
            with _toggle_lock:
                _toggle["depth"] -= 1
                if not _toggle["depth"]:
                    put(_toggle["restore"])
