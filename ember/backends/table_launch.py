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
waits for the device. A capture cannot record that copy (torch's pinned-memory allocator refuses),
so a table a capture needs and does not have is written by kernels (`fill`, which take the
addresses as arguments) that the capture records: each replay writes it again before the table
kernel reads it. Such a table is a temporary of the graph, like any intermediate buffer: it comes
from the capture's memory pool and is let go as soon as the launch is recorded. Keeping it would
hold a block of a graph's private pool past the graph's life, and torch refuses to capture into a
pool that no live graph uses but whose blocks are still held ("use_count > 0" in
CUDACachingAllocator), which is how one graph's release broke the next capture. A table a capture
finds (copied before, outside any pool) lives as long as the recording that reads it at every
replay (runtime/cudagraph_pool.py: keep_while_recorded), and is found again by its addresses while
it lives; under a capture of the caller's own it is kept for good (its graph's life is the caller's).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ember.codegen.triton_combo import TABLE_FILL_ARGS, TABLE_FILL_BIAS, TritonTableSource
from ember.runtime.cudagraph_pool import keep_while_recorded

# Tables kept outside CUDA graphs: the address sets a loop cycles through (gradients set to None
# and allocated again each step get the same few addresses from the caching allocator).
RECENT = 8

_data_ptr = torch.Tensor.data_ptr


class _Table:
    __slots__ = ("__weakref__", "aligned", "device", "host")

    def __init__(self, device: torch.Tensor, host: torch.Tensor | None, aligned: bool):
        self.device = device
        # The pinned memory copied from, held with the table (torch's pinned allocator reuses it only
        # once the copy is done); None for a table written on the device.
        self.host = host
        self.aligned = aligned


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
        self._device = device
        self._cuda = device.type == "cuda"
        with unset_fake_temporarily():
            self._heads = torch.tensor(source.heads, dtype=torch.int32, device=device)
            self._part_of_block = torch.tensor(source.part_of_block, dtype=torch.int32, device=device)
        self._fast, self._slow, self._fill = fast, slow, fill
        self._recent: OrderedDict[tuple, _Table] = OrderedDict()
        # Tables a capture found, read by a graph: held by its recording (or below, for good).
        self._kept: weakref.WeakValueDictionary[tuple, _Table] = weakref.WeakValueDictionary()
        self._kept_for_good: list[_Table] = []
        self._last: tuple = ((), (), None)  # (slots, addresses, table) of the last call outside a capture

    def __call__(self, stream, slots: tuple, *tensors: torch.Tensor) -> None:
        addresses = tuple(map(_data_ptr, tensors))
        capturing = self._cuda and torch.cuda.is_current_stream_capturing()
        last_slots, last_addresses, table = self._last
        if capturing or slots is not last_slots or addresses != last_addresses:
            table = self._table(slots, addresses, capturing)
            if not capturing:
                self._last = (slots, addresses, table)
        if table.aligned:
            self._fast(stream, table.device, self._heads, self._part_of_block)
        else:
            self._slow(table.device, self._heads, self._part_of_block)

    def _table(self, slots: tuple, addresses: tuple, capturing: bool) -> _Table:
        key = (slots, addresses)
        table = self._kept.get(key) or self._recent.get(key)
        if table is not None:
            if key in self._recent:
                self._recent.move_to_end(key)  # least recently used goes first
            if capturing:
                self._recent.pop(key, None)
                self._kept[key] = table
                if not keep_while_recorded(table) and table not in self._kept_for_good:
                    self._kept_for_good.append(table)
            return table
        rows, aligned = self._rows(slots, addresses)
        if capturing:
            return _Table(self._write_on_device(rows), None, aligned)  # the capture's temporary
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=self._cuda)
        table = _Table(host.to(self._device, non_blocking=True), host, aligned)
        self._recent[key] = table
        while len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        return table

    def _rows(self, slots: tuple, addresses: tuple) -> tuple[list[int], bool]:
        rows: list[int] = []
        aligned = True
        for part in self._parts:
            mine = [addresses[slots[b]] for b in part]
            rows += mine
            aligned = aligned and all(mine[k] % 16 == 0 for k in self._vector)
        return rows, aligned

    def _write_on_device(self, rows: list[int]) -> torch.Tensor:
        launches = -(-len(rows) // TABLE_FILL_ARGS)
        out = torch.empty(launches * TABLE_FILL_ARGS, dtype=torch.int64, device=self._device)
        values = [v + TABLE_FILL_BIAS for v in rows] + [TABLE_FILL_BIAS] * (len(out) - len(rows))
        for k in range(launches):
            self._fill(out[k * TABLE_FILL_ARGS :], values[k * TABLE_FILL_ARGS : (k + 1) * TABLE_FILL_ARGS])
        return out

    @property
    def tables(self) -> int:
        """Address tables held now (for tests)."""
        return len(self._recent) + len(self._kept)
