"""The launch of a table combo kernel (codegen/triton_combo.py: render_triton_table): the address
table of a call's buffers, and the kernel form their alignment allows.

A call passes each distinct tensor of the parts' buffers once (an in-place output is its input)
and `slots`, each kernel buffer's place among them; their addresses pick the table. An optimizer
step passes the same parameters, states and (mostly) gradients each step, so a table is built once
and found again: the last call's table by comparing addresses, else by a dict lookup over them; the
RECENT tables used last are kept. A call's host time is mostly reading the addresses (GPT-2's
AdamW step passes some 450 tensors to each of two table kernels). The parts' heads (first block and
count) and each block's part never change: they are made once, with the launch.

Outside a CUDA graph's capture a table is copied from pinned host memory, stream-ordered: nothing
waits for the device. A capture cannot record that copy (torch's pinned-memory allocator refuses).
Past RECENT tables, a new one takes the device memory of the one it evicts where every launch that
read that one ran on the new table's stream, so that the copy is ordered after them: a training
loop's gradients come at addresses that drift, and a fresh allocation for each table among them would
shift the allocator's blocks and keep them drifting. `ember.stats` counts `address_tables_built`.
Under a capture ember's pool records (runtime/cudagraph_pool.py), each launch gets a table of the
capture's own (`CapturedTable`, held by the recording, its memory outside the graph's pool): the pool
writes it from the host before the first replay, and again before a replay whose inputs read only
through tables (an optimizer step's gradients) come at new addresses, so those are never copied.
Under a capture of the caller's own, a table found by its addresses is kept for good (its graph's
life is the caller's), and a missing one is written by kernels the capture records (`fill`, which
take the addresses as arguments): each replay writes it again before the table kernel reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ember import stats
from ember.codegen.triton_combo import TABLE_FILL_ARGS, TABLE_FILL_BIAS, TritonTableSource
from ember.runtime.cudagraph_capture import CaptureScope, capture_scope, table_span

# Tables kept outside CUDA graphs: the address sets a loop cycles through (gradients set to None
# and allocated again each step get the same few addresses from the caching allocator).
RECENT = 8

_data_ptr = torch.Tensor.data_ptr

# A table's `stream` once launches on more than one stream have read it: equal to no stream.
_READ_ON_SEVERAL = -1


class _Table:
    __slots__ = ("aligned", "device", "host", "stream")

    def __init__(self, device: torch.Tensor, host: torch.Tensor | None, aligned: bool, stream: int | None = None):
        self.device = device
        # The pinned memory copied from, held with the table (torch's pinned allocator reuses it only
        # once the copy is done); None for a table written on the device.
        self.host = host
        self.aligned = aligned
        self.stream = stream  # the stream of every launch that read it (None: not named; or _READ_ON_SEVERAL)


class CapturedTable:
    """A table a capture of ember's pool recorded a launch with: rows that point into the inputs of
    `sources` follow those inputs (cudagraph_capture.RewritableTable)."""

    __slots__ = ("aligned", "device", "host", "launch", "positions", "slots", "sources")

    def __init__(self, launch: TableLaunch, slots: tuple, sources: tuple, device: torch.Tensor, aligned: bool):
        self.launch, self.slots, self.aligned = launch, slots, aligned
        # Per distinct tensor: (input position, bytes past its address), or (None, a fixed address).
        self.sources = sources
        self.positions = frozenset(k for k, _ in sources if k is not None)
        self.device = device  # outside the graph pool (CaptureScope.lasting)
        self.host: torch.Tensor | None = None

    def write(self, args: list) -> bool:
        addresses = [off if k is None else _data_ptr(args[k]) + off for k, off in self.sources]
        rows, aligned = self.launch.rows(self.slots, addresses)
        if self.aligned and not aligned:
            return False
        # Copied after the replays before it in stream order; the pinned memory is held until the next write.
        cuda = self.launch.device.type == "cuda"
        self.host = torch.tensor(rows, dtype=torch.int64, pin_memory=cuda)
        self.device.copy_(self.host, non_blocking=True)
        if cuda:  # written (and replayed) on a stream other than the one it was allocated on: freed after it
            self.device.record_stream(torch.cuda.current_stream(self.launch.device))
        return True


class TableLaunch:
    """Called by the host program with the stream, `slots` and the distinct tensors among the kernel's
    buffers (`source.params`' order; buffer k is `tensors[slots[k]]`):
    launches `fast(stream, table, heads, part_of_block)` where every vector buffer is 16-byte
    aligned, else `slow(table, heads, part_of_block)` (the form that assumes nothing).
    `fill(out, values)` launches the kernel that writes TABLE_FILL_ARGS values (biased) at `out`.
    Made while compiling: the constant tables are made outside the compiler's fake tensors."""

    def __init__(self, source: TritonTableSource, device: torch.device, fast: Callable, slow: Callable, fill: Callable):
        self._parts = [tuple(b) for b in source.part_buffers]
        self._vector = [k for k, along in enumerate(source.vector) if along]
        self.device = device
        self._cuda = device.type == "cuda"
        with unset_fake_temporarily():
            self._heads = torch.tensor(source.heads, dtype=torch.int32, device=device)
            self._part_of_block = source.part_of_block().to(device)
        self._fast, self._slow, self._fill = fast, slow, fill
        self._recent: OrderedDict[tuple, _Table] = OrderedDict()
        self._kept: dict[tuple, _Table] = {}  # tables a capture of the caller's own found: read by its graph
        self._last: tuple = ((), (), None)  # (slots, addresses, table) of the last call outside a capture

    def __call__(self, stream, slots: tuple, *tensors: torch.Tensor) -> None:
        addresses = tuple(map(_data_ptr, tensors))
        last_slots, last_addresses, table = self._last
        if self._cuda and torch.cuda.is_current_stream_capturing():
            table = self._for_capture(slots, tensors, addresses)
        else:
            if slots is not last_slots or addresses != last_addresses:
                table = self._table(slots, addresses, stream)
                self._last = (slots, addresses, table)
            if table.stream != stream:
                table.stream = _READ_ON_SEVERAL  # its memory is never written over (a stream may still read it)
        if table.aligned:
            self._fast(stream, table.device, self._heads, self._part_of_block)
        else:
            self._slow(table.device, self._heads, self._part_of_block)

    def _table(self, slots: tuple, addresses: tuple, stream: int | None) -> _Table:
        key = (slots, addresses)
        table = self._kept.get(key) or self._recent.get(key)
        if table is not None:
            if key in self._recent:
                self._recent.move_to_end(key)  # least recently used goes first
            return table
        stats.add("address_tables_built")
        rows, aligned = self.rows(slots, addresses)
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=self._cuda)
        # The evicted table is neither `_last` (the most recently used) nor kept by a capture. Its memory is
        # written over where every launch that read it ran on this call's stream, which orders the copy after
        # them; a launch that does not name its stream (None) leaves nothing to compare on a GPU.
        evicted = self._recent.popitem(last=False)[1] if len(self._recent) >= RECENT else None
        if evicted is not None and evicted.stream == stream and (stream is not None or not self._cuda):
            device = evicted.device.copy_(host, non_blocking=True)
        else:
            device = host.to(self.device, non_blocking=True)
        table = _Table(device, host, aligned, stream)
        self._recent[key] = table
        return table

    def _for_capture(self, slots: tuple, tensors: tuple, addresses: tuple) -> _Table | CapturedTable:
        scope = capture_scope()
        if scope is not None:
            return self._captured(scope, slots, tensors, addresses)
        key = (slots, addresses)
        table = self._kept.get(key) or self._recent.pop(key, None)
        if table is not None:
            self._kept[key] = table
            return table
        rows, aligned = self.rows(slots, addresses)
        return _Table(self._write_on_device(rows), None, aligned)  # the capture's temporary

    def _captured(self, scope: CaptureScope, slots: tuple, tensors: tuple, addresses: tuple) -> CapturedTable:
        sources = []
        for t, address in zip(tensors, addresses, strict=True):
            found = scope.table_inputs.get(t.untyped_storage().data_ptr())
            sources.append((None, address) if found is None else (found[0], address - found[1]))
        rows, aligned = self.rows(slots, addresses)
        table = CapturedTable(self, slots, tuple(sources), scope.lasting(len(rows), self.device), aligned)
        scope.tables.append(table)
        return table

    @property
    def rows_per_table(self) -> int:
        """A table's rows: one per part and buffer."""
        return sum(len(part) for part in self._parts)

    @property
    def rows_per_call(self) -> int:
        """What one call's table takes of a capture's reserve (runtime/cudagraph_capture.py: table_span)."""
        return table_span(self.rows_per_table)

    def rows(self, slots: tuple, addresses: tuple) -> tuple[list[int], bool]:
        rows: list[int] = []
        aligned = True
        for part in self._parts:
            mine = [addresses[slots[b]] for b in part]
            rows += mine
            aligned = aligned and all(mine[k] % 16 == 0 for k in self._vector)
        return rows, aligned

    def _write_on_device(self, rows: list[int]) -> torch.Tensor:
        launches = -(-len(rows) // TABLE_FILL_ARGS)
        out = torch.empty(launches * TABLE_FILL_ARGS, dtype=torch.int64, device=self.device)
        values = [v + TABLE_FILL_BIAS for v in rows] + [TABLE_FILL_BIAS] * (len(out) - len(rows))
        for k in range(launches):
            self._fill(out[k * TABLE_FILL_ARGS :], values[k * TABLE_FILL_ARGS : (k + 1) * TABLE_FILL_ARGS])
        return out

    @property
    def tables(self) -> int:
        """Address tables held now (for tests)."""
        return len(self._recent) + len(self._kept)
