"""The memory pool and step bookkeeping of CUDA graphs (runtime/cudagraphs.py wraps graphs in it;
each capture's own bookkeeping is a runtime/cudagraph_recording.py `Recording`).

A `Pool` holds the live recordings one recorder made on one device, in order (all in one memory
pool, a new one once every recording of the last was released), and the step: which
outputs the caller may still read, which are of an earlier step (invalidated before a replay writes
over them), and whether a replay now could write over an output still held in this step.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ember import config, log
from ember.runtime.cudagraph_capture import CaptureScope, _capture
from ember.runtime.cudagraph_judge import HOST_TIMED_CALLS, REPLAYS_HOST_TIMED, keep_or_drop
from ember.runtime.cudagraph_keys import MOVED_KEYS, SHORT_LIVED, moved_only, moved_static, what_changed
from ember.runtime.cudagraph_recording import Recording, tensor_meta, unowned_view

# PyTorch's own wording, so users meet the message its CUDA graph trees give for the same mistake.
OVERWRITTEN = (
    "Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run. "
    "To prevent overwriting, clone the tensor outside of torch.compile() or call "
    "torch.compiler.cudagraph_mark_step_begin() before each model invocation."
)
GRADIENT_OVERWRITTEN = (
    "Error: accessing gradient tensor output of CUDAGraphs that has been overwritten by a subsequent run. "
    "This can happen with torch.compile(mode='reduce-overhead') and gradient accumulation when a .grad "
    "tensor is a backward graph's output: set .grad to None before each backward (optimizer.zero_grad()), "
    "or allocate the .grad tensors before the compiled backward first runs."
)


class Recorder(Protocol):
    """The device calls CUDA graphs need; everything else here is bookkeeping."""

    device_type: str  # the device whose graphs it records ("cuda")

    def new_pool(self) -> Any: ...

    def record(self, run: Callable[[], list], inputs: list, pool: Any) -> tuple[Any, list]:
        """Capture `run()` into a graph whose allocations come from `pool`; (graph, run's outputs).
        `inputs`: what the graph reads; a capture computes nothing, so they stay as they are."""

    def replay(self, graph: Any) -> None: ...

    def invalidate(self, storage: int, message: str) -> None:
        """Make reading the storage (its StorageImpl pointer) raise `message`."""

    def time_device(self, run: Callable[[], Any]) -> tuple[Any, float]:
        """(run(), the seconds the device spends on the work it issues): waits for that work."""

    def time_host(self, run: Callable[[], Any], what: str) -> tuple[Any, float]:
        """(run(), the seconds the host spends in it); `what`: "host program" or "replay" (the pool's
        bookkeeping of one, its copies and its launch)."""

    def stream(self) -> Any:
        """The stream work is issued on now (compared for equality only)."""


class GraphedCall(Protocol):
    """What the pool reads and calls of a compiled graph under CUDA graphs (cudagraphs.Graphed)."""

    program: Callable[[list], list]
    kind: str  # inference, forward or backward
    static: frozenset[int]
    table_inputs: frozenset[int]  # inputs read only through address tables (codegen/host.py)
    table_rows: int  # the address-table rows a call writes (codegen/host.py)
    mutated: tuple[int, ...]
    max_graphs: int
    # Outputs at positions from here on are handed out over the pool's memory; the ones before are copied
    # (the default mode's graphs: an inference graph copies every one, a training forward all but the
    # tensors its backward reads). 0: every one handed out; None: none. A recording starts from it.
    handed_from: int | None
    # The default mode's: its recordings must pay for their copies (cudagraph_judge.keep_or_drop), judged against
    # the host program's time on a call of the same key.
    default_mode: bool
    copy_share: float  # the share of a replay's device time its copies may take whatever the host's time
    copy_bandwidth: float  # bytes/s of a large copy on the device (the Target's measured one; 0: unknown)
    host_seconds: dict[tuple, float]  # key -> the least of the host program's times on calls of it
    host_timed: dict[tuple, int]  # key -> how many calls of it were timed (HOST_TIMED_CALLS)
    recordings: dict
    seen: set
    last: Any
    short_lived: int  # recordings in a row released, a static input dropped, after fewer than SHORT_LIVED replays

    def find(self, args: list) -> tuple[tuple | None, Any]:
        """(the call's key, its recording or None); the key is None only where the recording is the last
        one replayed and the call's table inputs lie where its tables point (`rec.bound`)."""
        ...

    def disable(self, reason: str) -> None: ...

    def note_held(self) -> None: ...

    def note_unsuited(self) -> None: ...

    def note_other_stream(self) -> None: ...


# -- steps ---------------------------------------------------------------------------------------


def _generation() -> tuple[int, bool]:
    """(the current step's number, whether the user marks steps): PyTorch's, which
    torch.compiler.cudagraph_mark_step_begin() counts down and each torch.compile'd invocation up."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    marked = trees.MarkStepBox.mark_step_counter if trees is not None else 0
    if marked:
        return marked, True
    if not _tracker:
        from torch._dynamo.mutation_guard import GenerationTracker

        _tracker.append(GenerationTracker)
    return _tracker[0].generation, False


_tracker: list = []  # Dynamo's GenerationTracker, imported on first use


def _same_addresses_in_python(tensors: list, addresses: list[int], positions: list[int]) -> bool:
    return all(tensors[k].data_ptr() == addresses[k] for k in positions)


# PyTorch's check of static inputs' addresses, in C++ where its CUDA build has it.
same_addresses = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", _same_addresses_in_python)


def _alone_in_storage(args: list, positions: frozenset[int]) -> set[int]:
    """The tensors among `positions` that share their storage with no other input: a table row found
    by its storage at capture then points into that input, whatever address it comes at later."""
    counts: dict[int, int] = {}
    for a in args:
        if isinstance(a, torch.Tensor):
            ptr = a.untyped_storage().data_ptr()
            counts[ptr] = counts.get(ptr, 0) + 1
    return {
        k for k in positions if isinstance(args[k], torch.Tensor) and counts[args[k].untyped_storage().data_ptr()] == 1
    }


def _recorded(rec: Recording, recordings: int) -> str:
    """The log's line for a new recording: what each of its replays copies in, and what it reads where it is."""
    return (
        f"recorded CUDA graph {rec.index} ({recordings} for it): a replay copies in {len(rec.copy_in)} "
        f"input{'' if len(rec.copy_in) == 1 else 's'} "
        f"({rec.copy_in_bytes / 1e6:.3g} MB); {len(rec.rebound)} read through address tables, "
        f"{len(rec.in_pool)} in the pool's memory"
    )


def _copied_bytes(t: torch.Tensor, index: Any) -> int:
    """The bytes a replay copies of input t (`_copy`: a broadcast input's one position along its stride-0 dims)."""
    part = t if index is None else t[index]
    return part.numel() * part.element_size()


def _copy_index(t: torch.Tensor) -> Any:
    """Where a buffer with t's layout is written: broadcast (stride 0) dims at one position."""
    if all(st != 0 or n <= 1 for n, st in zip(t.shape, t.stride())):
        return None
    return tuple(0 if st == 0 and n > 1 else slice(None) for n, st in zip(t.shape, t.stride()))


def _copy(dst: torch.Tensor, src: torch.Tensor, index: Any) -> None:
    if index is None:
        dst.copy_(src)
    else:
        dst[index].copy_(src[index])


class Pool:
    """The memory pool and step bookkeeping of every graph one recorder records on one device."""

    def __init__(self, recorder: Recorder, device: torch.device, with_steps: bool = True):
        self.recorder = recorder
        self.device = device
        # False: the pool of the default mode's graphs (setting cudagraphs_default), which return copies of
        # what a caller keeps. Only autograd reads its memory, through the tensors a training forward saves
        # for its backward, and a replay that could write over one still held runs without its graph, so
        # it has no steps and nothing in it is ever invalidated.
        self.with_steps = with_steps
        self.handle = recorder.new_pool()
        self.recordings: list[Recording] = []  # in the order they were recorded
        # Recordings made or released so far: a change to the pool's memory, which may move an input into
        # it (an output of a new recording), so that a call's key no longer names the recording it found.
        self.changes = 0
        self._resident: tuple[int, frozenset[int]] = (-1, frozenset())  # (changes, resident()) when last found
        self.generation: int | None = None
        # The default mode's pool: the stream its first recording was made on. Its replays and their copies are
        # ordered by that stream alone; a call on another could overwrite outputs or buffers a replay queued
        # there has not yet read, so it runs its host program (whose memory the allocator orders across streams).
        self.stream: Any = None
        self.pending_backward = False  # a forward ran whose backward has not
        # The default mode's: the last forward called ran its host program on its way to a recording (a warm-up
        # or a timed call). Its saved tensors then lie at fresh addresses, which a backward's keys would take for
        # saved tensors that move at every step (MOVED_KEYS): the backward waits for the forward to settle.
        self.forward_settling = False
        # Outputs of earlier steps, with the message reading them will raise: invalidated at the next replay.
        self.stale: list[tuple[StorageWeakRef, str]] = []
        # Recordings of graphs that were dropped or disabled, released once no output they handed out is alive.
        self.dying: list[Recording] = []
        self.lock = threading.RLock()

    def release(self, recordings: list[Recording]) -> None:
        """The recordings of a compiled graph that is gone (or runs without CUDA graphs from now on):
        their graphs and memory are freed now, or once the caller holds none of their outputs."""
        with self.lock:
            self.dying += [r for r in recordings if not r.released]
            self._reap()

    def _reap(self) -> None:
        alive = []
        for rec in self.dying:
            if rec.any_given_alive():
                alive.append(rec)
            else:
                rec.release()
                self.changes += 1
        self.dying = alive

    def run(self, fn: GraphedCall, args: list) -> list:
        # One call at a time: threads share the pool's step, its recordings and their buffers.
        with self.lock:
            return self._run(fn, args)

    def _run(self, fn: GraphedCall, args: list) -> list:
        if self.with_steps:
            self._maybe_begin_step()
        if self.dying:
            self._reap()
        if not self.with_steps and self.stream is not None and self.recorder.stream() != self.stream:
            fn.note_other_stream()
            return self._plain(fn, args)
        key, rec = fn.find(args)
        if key is not None and rec is not None:
            rec.checked = self.changes  # found by its key: the last-call check may take it until the pool changes
        settling = fn.default_mode and fn.kind == "forward"
        if rec is None:
            if fn.default_mode and fn.kind == "backward" and self.forward_settling:
                return self._plain(fn, args)
            if fn.default_mode and key in fn.seen and fn.host_timed.get(key, 0) < HOST_TIMED_CALLS:
                return self._timed_plain(fn, key, args, settling)
            rec = self._recording_for(fn, key, args)
            if rec is None:
                if settling:  # a warm-up, unless the graph was just disabled
                    self.forward_settling = fn.disabled is None
                return self._plain(fn, args)
        elif self._held_from(rec):
            fn.note_held()
            if not self.with_steps:
                self._copy_held(rec)
            return self._plain(fn, args)
        if settling:
            self.forward_settling = False
        # Found as the last one replayed (no key): find() saw its table inputs where its tables point.
        tables_current = key is None
        if fn.default_mode and not rec.judged and rec.device_seconds is not None:
            out, seconds = self.recorder.time_host(lambda: self._replay(fn, rec, args, tables_current), "replay")
            rec.replay_host_seconds = min(rec.replay_host_seconds, seconds)
            rec.replays_host_timed += 1
            if rec.replays_host_timed >= REPLAYS_HOST_TIMED:
                keep_or_drop(fn, rec)
            return out
        return self._replay(fn, rec, args, tables_current)

    def _maybe_begin_step(self) -> None:
        generation, marked = _generation()
        if generation == self.generation or (self.pending_backward and not marked):
            return  # the same step; or a forward whose backward is still to come
        self.generation = generation
        for rec in self.recordings:
            message = GRADIENT_OVERWRITTEN if rec.kind == "backward" else OVERWRITTEN
            self.stale += [(ref, message) for ref in rec.live]
            rec.live = []

    def _held_from(self, rec: Recording) -> bool:
        """Whether an output of this step that `rec`'s replay could write over is still held: its
        own, or one of a later recording's (which may lie in rec's temporaries)."""
        return any(r.held() for r in self.recordings[rec.index :])

    def _copy_held(self, rec: Recording) -> None:
        """The default mode hands a backward's gradients out over the pool's memory: in a loop that sets
        them to None before the next step (`optimizer.zero_grad()`), nothing is copied. Where one is still
        held when a replay could write over it (gradients accumulated over micro-batches, or `zero_grad`
        called after the forward), that replay ran without its graph; the backward's replays copy its
        gradients from then on, and its next replay is timed again (cudagraph_judge.keep_or_drop), since its copies now
        cost device time."""
        for r in self.recordings[rec.index :]:
            if r.kind == "backward" and r.handed_from == 0 and r.held():
                r.handed_from = None
                r.judge_again()
                log.artifact(
                    "cudagraphs",
                    "backward graph",
                    f"recording {r.index}: its gradients were still held when a replay could write over them; "
                    "its replays copy them from now on",
                )

    def _ran(self, fn: GraphedCall) -> None:
        if fn.kind == "forward":
            self.pending_backward = True
        elif fn.kind == "backward":
            self.pending_backward = False

    def _plain(self, fn: GraphedCall, args: list) -> list:
        out = fn.program(args)
        self._ran(fn)
        return out

    def _timed_plain(self, fn: GraphedCall, key: tuple, args: list, settling: bool) -> list:
        """A default-mode call of a key seen before, not yet recorded: the host program, timed on the host.
        The least time of HOST_TIMED_CALLS such calls is what the recording made after them must beat
        (cudagraph_judge.keep_or_drop); the first call's would count one-time work (modules loaded, libraries set up)."""
        if settling:
            self.forward_settling = True
        out, seconds = self.recorder.time_host(lambda: self._plain(fn, args), "host program")
        fn.host_seconds[key] = min(fn.host_seconds.get(key, seconds), seconds)
        fn.host_timed[key] = fn.host_timed.get(key, 0) + 1
        return out

    def _recording_for(self, fn: GraphedCall, key: tuple, args: list) -> Recording | None:
        """None: this call runs the host program (a warm-up, or past the bound)."""
        if key not in fn.seen:
            backward = fn.default_mode and fn.kind == "backward"
            replaced = [] if backward else self._release_orphans(fn)
            if not backward and len(fn.seen) >= fn.max_graphs and fn.recordings:
                gc.collect()  # a tensor dropped in a reference cycle (a cache object's) is held until it runs
                replaced += self._release_orphans(fn)
            if fn.short_lived >= fn.max_graphs:
                fn.disable(
                    f"{fn.short_lived} recordings in a row replayed fewer than {SHORT_LIVED} times each before a static "
                    "input of theirs was dropped (a tensor made anew every few calls): recording for each new one "
                    "would cost more than its replays save; it runs without CUDA graphs from here"
                )
                return None
            if backward and len(fn.seen) >= MOVED_KEYS and moved_static(fn.seen, fn.static, key, args, self.resident()):
                fn.disable(
                    "its saved tensors lie at a new address again (a forward run without a graph saves fresh "
                    "ones): a recording per address would record at every step"
                )
                return None
            if len(fn.seen) >= fn.max_graphs:
                fn.disable(
                    f"more than cudagraphs_max_graphs={fn.max_graphs} different inputs (shapes, or "
                    f"addresses of parameters and other static inputs; {what_changed(fn.seen, fn.static, key, len(args))}): "
                    "it runs without CUDA graphs from here"
                )
                return None
            fn.seen.add(key)
            like = next((old for old in replaced if moved_only(fn.static, old[0], key, len(args))), None)
            if like is None or (fn.default_mode and like[1] is None):
                return None  # warm-up: kernels load and libraries set up outside the capture
            # The same call as a released recording's but for the static inputs made anew: nothing to warm up,
            # and (the default mode's) the host program's time on the released key's call stands for this one's.
            if like[1] is not None:
                fn.host_seconds[key], fn.host_timed[key] = like[1], HOST_TIMED_CALLS
        try:
            rec = self._record(fn, args)
        except Exception as e:
            if config.get("strict"):
                raise
            fn.disable(f"its capture failed: {type(e).__name__}: {e}"[:300])
            return None
        fn.recordings[key] = rec
        rec.host_seconds, rec.handed_from = fn.host_seconds.get(key, 0.0), fn.handed_from
        log.artifact("cudagraphs", f"{fn.kind} graph", lambda: _recorded(rec, len(fn.recordings)))
        return rec

    def _release_orphans(self, fn: GraphedCall) -> list[tuple[tuple, float | None]]:
        """Release fn's recordings that can never replay: a static input of theirs is held by nothing but
        them (Recording.orphaned_input). Their keys leave `fn.seen`, so they do not count against the bound,
        and the memory they held (that input's, their graph's) goes back once no output they handed out is
        held. Returns (key, the host program's time on its call or None) of each."""
        released = []
        for key, rec in list(fn.recordings.items()):
            k = rec.orphaned_input()
            if k is None:
                continue
            del fn.recordings[key]
            fn.seen.discard(key)
            if fn.last is rec:
                fn.last = None
            # Short-lived ones in a row: a long-running server's occasional short request does not add up.
            fn.short_lived = fn.short_lived + 1 if rec.replays < SHORT_LIVED else 0
            self.release([rec])
            fn.host_timed.pop(key, None)
            released.append((key, fn.host_seconds.pop(key, None)))
            log.artifact(
                "cudagraphs",
                f"{fn.kind} graph",
                f"recording {rec.index} released after {rec.replays} replays: its static input {k} is held by "
                "nothing else (made anew, as a static KV cache by each generate() call)",
            )
        return released

    def resident(self) -> frozenset[int]:
        """The storages (data pointers) of the outputs of this pool's live recordings: an input that
        lives in one is read where it is (its address is in the recording's key), not copied."""
        changes, found = self._resident
        if changes != self.changes:
            found = frozenset(ptr for rec in self.recordings if not rec.released for ptr, _ in rec.storages)
            self._resident = (self.changes, found)
        return found

    def _record(self, fn: GraphedCall, args: list) -> Recording:
        inputs, copy_in, rebound, in_pool = [], [], [], []
        tabled = _alone_in_storage(args, fn.table_inputs) if self.recorder.device_type == "cuda" else set()
        resident = self.resident()
        for k, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                inputs.append(a)
            elif k in fn.static:
                # A static input in the pool's memory (a saved tensor an earlier recording handed out) is held
                # without owning it: holding it would keep that recording's output held, and it from replaying.
                inputs.append(unowned_view(a) if a.untyped_storage().data_ptr() in resident else a)
            elif k in tabled:
                inputs.append(a)  # read where it is: each replay points the tables at the call's own
                rebound.append(k)
            elif a.untyped_storage().data_ptr() in resident:
                # Read where it is; the recording holds a view that does not own the memory (holding the
                # handed-out tensor would keep its recording's output held, and that graph from replaying).
                inputs.append(unowned_view(a))
                in_pool.append(k)
            else:
                inputs.append(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device))
                copy_in.append((k, _copy_index(a)))
                _copy(inputs[-1], a, copy_in[-1][1])  # the capture sees real values (a fake recorder runs it)
        if self.recordings and all(r.released for r in self.recordings):
            # No live graph captured into this pool. torch drops a private pool when its last graph
            # goes, unless a block of it is still allocated; a capture into a pool kept that way trips
            # torch's internal assert ("use_count > 0") and leaves its RNG in capture state. A new pool
            # costs nothing; the log says so, since a block held past its graphs is a leak to find.
            self.handle = self.recorder.new_pool()
            self.recordings = []
            self.changes += 1
            log.artifact("cudagraphs", "memory pool", "every recording of the last pool was released: a new pool")
        # The function recorded holds the program, not `fn`: a recording must not keep its graph alive.
        program = fn.program
        if not self.with_steps and self.stream is None:
            self.stream = self.recorder.stream()
        _capture.scope = scope = CaptureScope(
            {args[k].untyped_storage().data_ptr(): (k, args[k].data_ptr()) for k in rebound},
            stream=self.recorder.stream() if self.recorder.device_type == "cuda" else None,
            # Allocated here, before the capture: the tables' memory, which the recording's tables hold.
            reserve=torch.empty(fn.table_rows, dtype=torch.int64, device=self.device) if fn.table_rows else None,
        )
        try:
            graph, outputs = self.recorder.record(lambda: program(list(inputs)), inputs, self.handle)
        finally:
            _capture.scope = None
        pointed = {k for table in scope.tables for k in table.positions}
        if set(rebound) - pointed:  # read some other way than through a table the pool can rewrite
            raise RuntimeError(f"inputs {sorted(set(rebound) - pointed)} were to be read only through address tables")
        for table in scope.tables:  # the capture is over: a copy from the host may be issued now
            if not table.write(args):
                raise RuntimeError("an address table's recorded kernel form does not suit its own capture's inputs")
        # Static inputs are the caller's own memory, and inputs in the pool an earlier recording's: an output
        # viewing one is the caller's (AOTAutograd remakes it from the caller's tensor). A copy buffer is the
        # recording's, which every replay writes: an output viewing it (a forward's saved input, a backward's
        # incoming gradient) is handed out like a pool output.
        caller_storages = {
            a.untyped_storage().data_ptr(): k
            for k, a in enumerate(inputs)
            if (k in fn.static or k in in_pool) and isinstance(a, torch.Tensor)
        }
        storages: dict[int, int] = {}  # data pointer -> number
        sizes: list[tuple[int, int]] = []
        handed, aliased = [], []
        for pos, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor):
                continue
            storage = o.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in caller_storages:
                aliased.append((pos, caller_storages[ptr], tensor_meta(o)))
                continue
            if ptr not in storages:
                storages[ptr] = len(sizes)
                sizes.append((ptr, storage.nbytes()))
            handed.append((pos, storages[ptr], tensor_meta(o)))
        copied = {k for k, _ in copy_in}
        static_tensors = sorted([k for k in fn.static if isinstance(args[k], torch.Tensor)] + in_pool)
        at_address = set(static_tensors)
        rec = Recording(
            index=len(self.recordings),
            kind=fn.kind,
            graph=graph,
            inputs=inputs,
            copy_in=copy_in,
            copy_out=[k for k in fn.mutated if k in copied],
            outputs=list(outputs),
            storages=sizes,
            handed=handed,
            aliased=aliased,
            static_tensors=static_tensors,
            addresses=[a.data_ptr() if k in at_address else 0 for k, a in enumerate(args)],
            strides=[(k, args[k].stride()) for k in (*copied, *rebound, *in_pool)],
            tables=list(scope.tables),
            rebound=rebound,
            in_pool=in_pool,
            owned_static=[k for k in fn.static if isinstance(args[k], torch.Tensor) and inputs[k] is args[k]],
            copy_in_bytes=sum(_copied_bytes(args[k], index) for k, index in copy_in),
            bound=[args[k].data_ptr() if k in rebound else 0 for k in range(len(args))],
        )
        for k in rebound:
            rec.inputs[k] = None  # the caller's tensor: not the recording's to keep
        self.recordings.append(rec)
        self.changes += 1
        rec.checked = self.changes
        return rec

    def _replay(self, fn: GraphedCall, rec: Recording, args: list, tables_current: bool = False) -> list:
        if rec.rebound and not tables_current and not same_addresses(args, rec.bound, rec.rebound):
            # Only tables pointing into the moved inputs change; the others keep their rows.
            if not all(table.write(args) for table in rec.tables if table.positions):
                rec.bound = [0] * len(rec.bound)  # written in part: written again at the next replay
                fn.note_unsuited()
                return self._plain(fn, args)
            for k in rec.rebound:
                rec.bound[k] = args[k].data_ptr()
        if rec.copy_whole:
            torch._foreach_copy_([rec.inputs[k] for k in rec.copy_whole], [args[k] for k in rec.copy_whole])
        for k, index in rec.copy_in:
            if index is not None:
                _copy(rec.inputs[k], args[k], index)
        written_back = [(args[k], rec.inputs[k]) for k in rec.copy_out]
        sources = [args[k].untyped_storage() for _, k, _ in rec.aliased]
        args.clear()  # the boxed convention: the caller's inputs are not kept past this call
        if self.stale:
            for ref, message in self.stale:
                if not ref.expired():
                    self.recorder.invalidate(ref.cdata, message)
            self.stale = []
        if fn.default_mode and not rec.judged and rec.device_seconds is None:  # the first replay: timed on the device
            _, rec.device_seconds = self.recorder.time_device(lambda: self.recorder.replay(rec.graph))
        else:
            self.recorder.replay(rec.graph)
        fn.last = rec
        rec.replays += 1
        for original, buffer in written_back:
            original.copy_(buffer)
        self._ran(fn)
        return rec.give(self.device, sources)


_pools: dict[tuple[int, str, bool], Pool] = {}


_lock = threading.Lock()


def live_pools() -> list[Pool]:
    """Every pool made so far (what a measurement of memory counts as CUDA graphs' own)."""
    with _lock:
        return list(_pools.values())


def pool_for(recorder: Recorder, device: torch.device, with_steps: bool = True) -> Pool:
    """The one pool of `recorder` on `device` whose graphs hand out their outputs under step rules (or,
    `with_steps=False`, the default mode's, which copy what a caller keeps)."""
    with _lock:
        key = (id(recorder), str(device), with_steps)
        pool = _pools.get(key)
        if pool is None or pool.recorder is not recorder:
            pool = _pools[key] = Pool(recorder, device, with_steps)
        return pool
