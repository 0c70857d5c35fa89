"""The launch of a table combo kernel (backends/table_launch.py): the address table a call's buffers
make, kept per set of addresses, the kernel form their alignment allows, and tables a CUDA graph's
capture writes with its own kernels. The launches are recorded, not run: what the kernels compute is
checked in tests/codegen/test_combo_kernels.py."""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ember.backends import table_launch
from ember.backends.table_launch import RECENT, TableLaunch
from ember.codegen.triton_combo import TABLE_FILL_ARGS, TABLE_FILL_BIAS, TritonTableSource
from ember.codegen.triton_launch import LaunchConfig


def _source() -> TritonTableSource:
    """Two parts of 40 and 8 elements in blocks of 16; the body's parameters are a vector read, a 0-d
    read and a vector write; the kernel's buffers are [p0, p1, counter, out0, out1]."""
    return TritonTableSource(
        kernel=None,
        source="",
        params=[],
        launch=LaunchConfig(16, 0, 1, False),
        part_buffers=[[0, 2, 3], [1, 2, 4]],
        vector=(True, False, True),
        first_blocks=[0, 3],
        numels=[40, 8],
        blocks=4,
    )


class _Recorder:
    def __init__(self):
        self.fast: list[list[int]] = []
        self.slow: list[list[int]] = []
        self.fills = 0

    def launch(self, cuda: bool = False) -> TableLaunch:
        def fast(stream, table, heads, blocks):
            assert heads.tolist() == [0, 40, 3, 8] and blocks.tolist() == [0, 0, 0, 1]
            self.fast.append(table.tolist())

        def slow(table, heads, blocks):
            self.slow.append(table.tolist())

        def fill(out, values):  # what ember_table_fill computes
            assert len(values) == TABLE_FILL_ARGS
            self.fills += 1
            out[: len(values)] = torch.tensor([v - TABLE_FILL_BIAS for v in values])

        launch = TableLaunch(_source(), torch.device("cpu"), fast, slow, fill)
        launch._cuda = cuda  # the capture's checks, on CPU tensors
        return launch


ALL = (0, 1, 2, 3, 4)  # each of the five buffers its own tensor


def _buffers(count: int = 5) -> list[torch.Tensor]:
    return [torch.zeros(64) for _ in range(count)]


def test_each_part_row_holds_its_first_block_count_and_addresses_in_body_order():
    rec = _Recorder()
    bufs = _buffers()
    rec.launch()(None, ALL, *bufs)
    a = [b.data_ptr() for b in bufs]
    assert rec.fast == [[a[0], a[2], a[3], a[1], a[2], a[4]]]
    assert not rec.slow


def test_each_block_s_part_comes_from_the_parts_first_blocks():
    assert _source().part_of_block().tolist() == [0, 0, 0, 1]
    three = dataclasses.replace(_source(), first_blocks=[0, 2, 3], numels=[32, 16, 64], blocks=7)
    assert three.part_of_block().tolist() == [0, 0, 1, 2, 2, 2, 2]
    assert three.part_of_block().dtype == torch.int32


def test_a_tensor_passed_once_fills_every_buffer_slot_it_stands_for():
    """An in-place step passes each tensor once: out0 is p0 and out1 is p1 (slots 0, 1, 2, 0, 1)."""
    rec = _Recorder()
    launch = rec.launch()
    p0, p1, counter = _buffers(3)
    inplace = (0, 1, 2, 0, 1)
    launch(None, inplace, p0, p1, counter)
    a = [p0.data_ptr(), p1.data_ptr(), counter.data_ptr()]
    assert rec.fast == [[a[0], a[2], a[0], a[1], a[2], a[1]]]
    launch(None, ALL, p0, p1, counter, p0, p1)  # the same addresses under other slots: a table of its own
    assert launch.tables == 2 and rec.fast[1] == rec.fast[0]
    launch(None, inplace, p0, p1, counter)
    assert launch.tables == 2


def test_a_call_with_the_last_calls_addresses_looks_nothing_up(monkeypatch):
    rec = _Recorder()
    launch = rec.launch()
    looked_up = []
    find = TableLaunch._table
    monkeypatch.setattr(TableLaunch, "_table", lambda self, *a: (looked_up.append(a[1]), find(self, *a))[1])
    bufs = _buffers()
    for _ in range(3):
        launch(None, ALL, *bufs)
    other = _buffers()
    launch(None, ALL, *other)
    launch(None, ALL, *bufs)  # no longer the last call's: found in the kept tables
    assert len(looked_up) == 3 and launch.tables == 2 and len(rec.fast) == 5


def test_same_addresses_reuse_their_table_and_new_ones_add_one_up_to_a_bound():
    rec = _Recorder()
    launch = rec.launch()
    bufs = _buffers()
    launch(None, ALL, *bufs)
    launch(None, ALL, *bufs)
    assert launch.tables == 1
    kept = []
    for _ in range(RECENT + 3):
        grads = _buffers(2)  # new tensors in the places of p0 and p1
        kept.append(grads)
        launch(None, ALL, *grads, *bufs[2:])
        launch(None, ALL, *bufs)  # used every step: never the least recently used
    assert launch.tables == RECENT
    built = len(rec.fast)
    launch(None, ALL, *bufs)
    launch(None, ALL, *kept[-1], *bufs[2:])
    assert launch.tables == RECENT and len(rec.fast) == built + 2
    launch(None, ALL, *kept[0], *bufs[2:])  # evicted long ago: built again
    assert launch.tables == RECENT
    assert rec.fast[-1][0] == kept[0][0].data_ptr() and rec.fast[-1][3] == kept[0][1].data_ptr()


def test_an_unaligned_vector_buffer_takes_the_form_that_assumes_nothing():
    rec = _Recorder()
    launch = rec.launch()
    bufs = _buffers()
    launch(None, ALL, *bufs[:4], bufs[4][1:])  # out1 one float in: 4-byte aligned
    assert len(rec.slow) == 1 and not rec.fast


def test_an_unaligned_scalar_buffer_keeps_the_aligned_form():
    rec = _Recorder()
    launch = rec.launch()
    bufs = _buffers()
    launch(None, ALL, *bufs[:2], bufs[2][3:], *bufs[3:])  # the 0-d counter is read at 0 only
    assert len(rec.fast) == 1 and not rec.slow


def test_a_capture_writes_a_missing_table_with_kernels_and_keeps_what_it_finds(monkeypatch):
    """Capturing, a table not held is written by the fill kernels (a copy from the host cannot be
    captured) and let go once its launch is recorded: it is the graph's temporary, and a block of
    the graph's pool held past the graph breaks the next capture into that pool. A later call outside
    the capture builds its own table. A table a capture finds is kept past the RECENT bound (the
    graph reads it at every replay)."""
    rec = _Recorder()
    launch = rec.launch(cuda=True)
    read: list[weakref.ref] = []
    fast = launch._fast
    launch._fast = lambda stream, table, *rest: (read.append(weakref.ref(table)), fast(stream, table, *rest))
    capturing = [True]
    monkeypatch.setattr(table_launch.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(table_launch.torch, "tensor", _unpinned(torch.tensor))  # no CUDA here to pin with
    bufs = _buffers()
    a = [b.data_ptr() for b in bufs]
    launch(None, ALL, *bufs)
    assert rec.fills == 1 and rec.fast[0][:6] == [a[0], a[2], a[3], a[1], a[2], a[4]]
    assert read[0]() is None and launch.tables == 0  # nothing of the capture's pool is held
    capturing[0] = False
    launch(None, ALL, *bufs)  # outside the graph: a table of its own, copied
    assert rec.fills == 1 and launch.tables == 1 and rec.fast[1] == rec.fast[0][:6]
    capturing[0] = True
    launch(None, ALL, *bufs)  # the capture finds the copied table: kept for good
    assert read[2]() is read[1]()
    capturing[0] = False
    others = [_buffers() for _ in range(RECENT + 2)]  # held: each set at addresses of its own
    for bufs_k in others:
        launch(None, ALL, *bufs_k)
    assert launch.tables == 1 + RECENT  # the kept one, the recent ones
    launch(None, ALL, *bufs)
    assert rec.fills == 1 and launch.tables == 1 + RECENT and read[-1]() is read[1]()


def _unpinned(tensor):
    def make(*args, pin_memory=False, **kwargs):
        return tensor(*args, **kwargs)

    return make


def test_a_pool_capture_records_a_table_whose_rows_follow_its_table_inputs(monkeypatch):
    """Under a capture ember's pool records, the launch reads a table of the capture's own and
    registers it; the pool writes it before a replay. Rows of an input the program reaches only
    through tables follow that input's address in the call; the others keep the capture's addresses.
    Addresses that would break the aligned form the capture recorded are refused."""
    from ember.runtime import cudagraph_capture

    rec = _Recorder()
    launch = rec.launch(cuda=True)
    monkeypatch.setattr(table_launch.torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(table_launch.torch, "tensor", _unpinned(torch.tensor))
    bufs = _buffers()
    args = [bufs[1], "not a tensor"]  # the graph's inputs: bufs[1] (p1) is read through tables only
    scope = cudagraph_capture.CaptureScope({bufs[1].untyped_storage().data_ptr(): (0, bufs[1].data_ptr())})
    lasting = []  # the table's memory comes from the scope: outside the graph pool on a GPU
    scope.lasting = lambda rows, device: lasting.append(torch.empty(rows, dtype=torch.int64)) or lasting[-1]
    cudagraph_capture._capture.scope = scope  # what Pool._record sets around its capture
    try:
        launch(None, ALL, *bufs)
    finally:
        cudagraph_capture._capture.scope = None
    (table,) = scope.tables
    assert len(lasting) == 1 and lasting[0] is table.device and len(table.device) == 6
    assert rec.fills == 0 and launch.tables == 0  # nothing found, nothing kept, no fill kernel
    a = [b.data_ptr() for b in bufs]
    assert table.write(args) and table.device.tolist() == [a[0], a[2], a[3], a[1], a[2], a[4]]
    moved = torch.zeros(64)
    assert table.write([moved, None]) and table.device.tolist()[3] == moved.data_ptr()
    assert table.device.tolist()[:3] == [a[0], a[2], a[3]]
    unaligned = torch.zeros(65)[1:]  # 4 bytes past a 16-byte boundary: the aligned form cannot read it
    assert not table.write([unaligned, None])


class _TableGraphRecorder:
    """A CUDA-typed recorder on the CPU: recording runs the program as a capture would (the launch
    sees a capturing stream), and a replay reads the tables the recorded launches took, as the
    table kernel would, into `replayed`."""

    device_type = "cuda"

    def __init__(self, monkeypatch, reads: list):
        self.capturing = False
        self.reads = reads
        self.replayed: list[list[int]] = []
        monkeypatch.setattr(table_launch.torch.cuda, "is_current_stream_capturing", lambda: self.capturing)

    def new_pool(self):
        return "pool"

    def stream(self):
        return None  # no stream to allocate a table's memory on: the CPU's allocator

    def record(self, run, inputs, pool):
        self.capturing, start = True, len(self.reads)
        try:
            outputs = run()
        finally:
            self.capturing = False
        return list(self.reads[start:]), outputs

    def replay(self, graph):
        self.replayed.append([t.tolist()[3] for t in graph])  # the row of p1, the input that moves

    def invalidate(self, storage, message):
        pass


def test_a_replay_points_the_tables_at_the_calls_inputs_and_copies_none(monkeypatch):
    """The pool records an input reached only through tables where it is (no buffer, no copy in or
    back), rewrites the table when the input comes at a new address, and runs the program without
    its graph for a call whose address the recorded form cannot take."""
    from ember.runtime import cudagraph_pool, cudagraphs

    monkeypatch.setattr(table_launch.torch, "tensor", _unpinned(torch.tensor))
    reads: list[torch.Tensor] = []
    rec = _Recorder()
    launch = rec.launch(cuda=True)
    fast = launch._fast
    launch._fast = lambda stream, table, *rest: (reads.append(table), fast(stream, table, *rest))
    fixed = _buffers(4)
    plain_runs = []

    def program(args):
        (p1,) = args
        args.clear()
        plain_runs.append(not recorder.capturing)
        launch(None, ALL, fixed[0], p1, fixed[1], fixed[2], fixed[3])
        return []

    program.table_inputs = frozenset({0})
    recorder = _TableGraphRecorder(monkeypatch, reads)
    pool = cudagraph_pool.Pool(recorder, torch.device("cpu"))
    graph = cudagraphs.Graphed(program, "inference", static=[], mutated=[0], pool=pool, symbolic=False)
    inputs = [torch.zeros(64) for _ in range(3)]
    for x in [inputs[0], inputs[0], inputs[0], inputs[1], inputs[2], inputs[1]]:
        graph([x])  # warm-up, record and replay, then replays
    (recording,) = pool.recordings
    assert recording.copy_in == [] and recording.copy_out == [] and recording.rebound == [0]
    assert recording.inputs == [None]  # the caller's tensor is not held
    assert recorder.replayed == [[x.data_ptr()] for x in [inputs[0], inputs[0], inputs[1], inputs[2], inputs[1]]]
    # A call whose table input moved is found by its key, not by the last recording's check: an input that
    # moved into the pool's memory (a later recording's output) keys a recording of its own.
    assert graph.find([inputs[1]])[0] is None and graph.find([inputs[2]])[0] is not None
    graph([torch.zeros(65)[1:]])  # unaligned: the recorded (aligned) form cannot read it
    assert plain_runs[-1] and len(recorder.replayed) == 5
    graph([inputs[2]])
    assert recorder.replayed[-1] == [inputs[2].data_ptr()] and len(pool.recordings) == 1


def test_a_new_table_past_the_bound_takes_the_evicted_tables_memory():
    """A loop's gradients at drifting addresses: each new table is written over the least recently used
    one's device memory instead of allocating, and reads its own addresses."""
    rec = _Recorder()
    launch = rec.launch()
    bufs = _buffers()
    held = [_buffers(2) for _ in range(RECENT + 3)]  # held: each pair at addresses of its own
    for grads in held[:RECENT]:
        launch(None, ALL, *grads, *bufs[2:])
    memory = {t.device.data_ptr() for t in launch._recent.values()}
    assert len(memory) == RECENT
    for grads in held[RECENT:]:
        launch(None, ALL, *grads, *bufs[2:])
        assert rec.fast[-1][0] == grads[0].data_ptr() and rec.fast[-1][3] == grads[1].data_ptr()
    assert launch.tables == RECENT and {t.device.data_ptr() for t in launch._recent.values()} == memory


def test_a_table_read_on_another_stream_is_not_written_over():
    """A table some launch read on another stream may still be read there: the next table past the bound
    gets fresh memory instead of its memory."""
    rec = _Recorder()
    launch = rec.launch()
    bufs = _buffers()
    held = [_buffers(2) for _ in range(RECENT + 1)]
    for grads in held[:RECENT]:
        launch(None, ALL, *grads, *bufs[2:])
    launch(7, ALL, *held[0], *bufs[2:])  # read again by a launch on stream 7
    for grads in held[1:RECENT]:
        launch(None, ALL, *grads, *bufs[2:])  # held[0]'s table is the least recently used again
    oldest = next(iter(launch._recent.values()))
    assert oldest.device[0].item() == held[0][0].data_ptr()  # held[0]'s table, evicted by the next miss
    memory = oldest.device.data_ptr()
    launch(None, ALL, *held[RECENT], *bufs[2:])
    assert launch._recent[list(launch._recent)[-1]].device.data_ptr() != memory
    assert rec.fast[-1][0] == held[RECENT][0].data_ptr()


def test_builds_are_counted():
    from ember import stats

    rec = _Recorder()
    launch = rec.launch()
    before = stats.snapshot()
    bufs = _buffers()
    for _ in range(3):
        launch(None, ALL, *bufs)
    launch(None, ALL, *_buffers())
    assert stats.delta(before)["address_tables_built"] == 2


def test_a_recording_holds_every_table_its_graph_reads(monkeypatch):
    """A table whose rows are all fixed addresses is never rewritten, yet a replay reads it: let go after the
    capture, its memory would be handed out again and the rows written over. A CUDA graph does not hold the
    tensors its kernels read; the recording holds the tables."""
    from ember.runtime import cudagraph_pool, cudagraphs

    monkeypatch.setattr(table_launch.torch, "tensor", _unpinned(torch.tensor))
    reads: list[weakref.ref] = []
    rec = _Recorder()
    launch = rec.launch(cuda=True)
    fast = launch._fast
    launch._fast = lambda stream, table, *rest: (reads.append(weakref.ref(table)), fast(stream, table, *rest))
    fixed = _buffers(5)

    def program(args):
        args.clear()
        launch(None, ALL, *fixed)
        return []

    program.table_inputs = frozenset()
    program.table_rows = launch.rows_per_call  # what the host program counts, and the pool sets aside

    class AddressesOnly(_TableGraphRecorder):
        def record(self, run, inputs, pool):
            graph, outputs = super().record(run, inputs, pool)
            self.captured = graph
            return [r().data_ptr() for r in graph], outputs  # addresses, as a CUDA graph keeps

        def replay(self, graph):
            self.replayed.append(graph)

    recorder = AddressesOnly(monkeypatch, reads)
    pool = cudagraph_pool.Pool(recorder, torch.device("cpu"))
    graph = cudagraphs.Graphed(program, "inference", static=[], mutated=[], pool=pool, symbolic=False)
    for _ in range(3):
        graph([])  # warm-up, record and replay, replay
    (recording,) = pool.recordings
    (table,) = recorder.captured
    assert not any(t.positions for t in recording.tables) and table() is recording.tables[0].device
    # Carved from the rows set aside before the capture: no allocation inside it.
    assert table()._base is not None and table()._base.numel() == launch.rows_per_call == 6
    assert recorder.replayed == [[table().data_ptr()]] * 2
    recording.release()
    assert table() is None


def test_a_table_past_the_rows_set_aside_gets_memory_of_its_own(monkeypatch):
    """A table kernel launched twice in one call needs two tables; the pool set aside one call's rows as the
    host program counts them (one launch each): the second comes from the allocator."""
    from ember.runtime import cudagraph_pool, cudagraphs

    monkeypatch.setattr(table_launch.torch, "tensor", _unpinned(torch.tensor))
    reads: list[torch.Tensor] = []
    launch = _Recorder().launch(cuda=True)
    fast = launch._fast
    launch._fast = lambda stream, table, *rest: (reads.append(table), fast(stream, table, *rest))
    fixed = _buffers(5)

    def program(args):
        args.clear()
        launch(None, ALL, *fixed)
        launch(None, ALL, *fixed)
        return []

    program.table_inputs = frozenset()
    program.table_rows = launch.rows_per_call
    recorder = _TableGraphRecorder(monkeypatch, reads)
    pool = cudagraph_pool.Pool(recorder, torch.device("cpu"))
    graph = cudagraphs.Graphed(program, "inference", static=[], mutated=[], pool=pool, symbolic=False)
    for _ in range(3):
        graph([])
    (recording,) = pool.recordings
    first, second = (t.device for t in recording.tables)
    assert first._base is not None and first._base.numel() == 6 and second._base is None
    assert (
        first.tolist()
        == second.tolist()
        == [b.data_ptr() for b in (fixed[0], fixed[2], fixed[3], fixed[1], fixed[2], fixed[4])]
    )


def test_tables_carved_from_the_reserve_start_16_bytes_apart():
    """Kernels take every pointer as 16-byte aligned: a table of an odd row count leaves a row free before
    the next; a table the reserve cannot hold is allocated apart."""
    from ember.runtime.cudagraph_capture import CaptureScope

    reserve = torch.empty(8, dtype=torch.int64)
    scope = CaptureScope({}, reserve=reserve)
    first, second, third = (scope.lasting(3, reserve.device) for _ in range(3))
    base = reserve.data_ptr()
    assert (first.data_ptr() - base, second.data_ptr() - base) == (0, 32) and len(first) == len(second) == 3
    assert third.untyped_storage().data_ptr() != reserve.untyped_storage().data_ptr() and len(third) == 3
