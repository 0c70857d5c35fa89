"""CUDA graphs around compiled graphs: `mode="reduce-overhead"`, or `options={"cudagraphs": True}`.

A compiled graph's launches are recorded into a CUDA graph and replayed: a call costs one graph
launch, not one host-side launch per kernel. The rules are those users know from Inductor's CUDA
graph trees (docs/cudagraphs.md says them for users):

- Warm-up: the first call with a given key (the addresses of static inputs, the shapes and strides
  of the others, integer inputs) runs the host program as usual; the next one records, then replays.
  At most `cudagraphs_max_graphs` keys per compiled graph; past that it runs without CUDA graphs
  and warns once.
- Static inputs (parameters, buffers, a backward's saved tensors: what AOTAutograd marks static)
  are read where they are; the others are copied into buffers the recording owns.
- One memory pool per device (and recorder) is shared by every recorded graph, the forward and
  backward of a training step among them. A recording's outputs stay allocated, so no later
  recording places anything over them; its temporaries may be reused by later recordings.
- Outputs live in the pool and the next replay overwrites them. A step begins at
  `torch.compiler.cudagraph_mark_step_begin()`, or at the next torch.compile'd invocation when no
  backward is pending; outputs of earlier steps are then invalidated (reading them raises PyTorch's
  error) before a replay can overwrite them. Within a step, a graph whose replay could overwrite
  an output that is still held (its own, or one of a later recording, which may lie in its
  temporaries) runs without its CUDA graph for that call: fresh outputs, never a silent overwrite.
- Mutated inputs are captured: a static one is written in place by the graph, another is copied
  back after the replay.
- What cannot be captured (`refusals`: CPU tensors, host syncs, data-dependent sizes, RNG with an
  explicit generator, ops marked cudagraph_unsafe) runs without CUDA graphs and says why
  (EMBER_LOGS=cudagraphs, EMBER_DEBUG=1, the graph's report in ember.explain).

The device calls go through a `Recorder` (pool, record, replay, invalidate): `CudaRecorder` on a
GPU; tests pass a fake one with `use_recorder`, which is how the bookkeeping runs on a CPU.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ember import config, log

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


class CudaRecorder:
    device_type = "cuda"

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def record(self, run: Callable[[], list], inputs: list, pool: Any) -> tuple[Any, list]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = run()
        return graph, outputs

    def replay(self, graph: Any) -> None:
        graph.replay()

    def invalidate(self, storage: int, message: str) -> None:
        torch._C._set_storage_data_ptr_access_error_msg(storage, message)


_recorders: list[Recorder] = []
_default_recorder: list[Recorder] = []
_lock = threading.Lock()


@contextlib.contextmanager
def use_recorder(recorder: Recorder) -> Iterator[Recorder]:
    """Graphs compiled while the block runs record through `recorder` (tests pass a fake one)."""
    with _lock:
        _recorders.append(recorder)
    try:
        yield recorder
    finally:
        with _lock:
            _recorders.remove(recorder)


def current_recorder() -> Recorder:
    with _lock:
        if _recorders:
            return _recorders[-1]
        if not _default_recorder:
            _default_recorder.append(CudaRecorder())
        return _default_recorder[0]


# -- what a graph allows -------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptureFacts:
    """What decides whether a compiled graph can be captured, read off its ATen graph."""

    device: str  # the graph's device
    other_device_inputs: tuple[tuple[int, str], ...]  # (input position, device type)
    extern_refusals: tuple[str, ...]
    mutated_inputs: tuple[int, ...]  # positions of inputs the graph writes (copy_ into them)
    symbolic: bool = False  # sizes vary from call to call: a recording is for one set of them
    num_outputs: int = 0  # tensors the graph returns


def capture_facts(gm: torch.fx.GraphModule, device: torch.device) -> CaptureFacts:
    """The facts of the ATen graph `gm`, compiled for `device`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positions = {n: k for k, n in enumerate(placeholders)}
    others, symbolic = [], False
    for k, n in enumerate(placeholders):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type != device.type:
            others.append((k, val.device.type))
        if isinstance(val, torch.SymInt) or (
            isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in (*val.shape, *val.stride()))
        ):
            symbolic = True
    reasons: list[str] = []
    mutated: list[int] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        reason = extern_refusal(node.target, node.args, node.kwargs)
        if reason and reason not in reasons:
            reasons.append(reason)
        if node.target is torch.ops.aten.copy_.default and node.args[0] in positions:
            mutated.append(positions[node.args[0]])
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    returned = torch.fx.node.map_arg(outputs[0].args, lambda n: n) if outputs else ()
    tensors = [n for n in torch.utils._pytree.tree_leaves(returned) if isinstance(n, torch.fx.Node)]
    return CaptureFacts(str(device), tuple(others), tuple(reasons), tuple(mutated), symbolic, len(tensors))


def extern_refusal(target: Any, args: Sequence, kwargs: dict) -> str | None:
    """Why an ATen call cannot be captured into a CUDA graph, or None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = f"aten.{target._opname}" if target.namespace == "aten" else str(target)
    tags = set(target.tags)
    if getattr(torch.Tag, "cudagraph_unsafe", None) in tags:
        return f"{name} is marked cudagraph_unsafe"
    if torch.Tag.dynamic_output_shape in tags:
        return f"data-dependent sizes: {name}"
    if torch.Tag.data_dependent_output in tags:
        return f"a sync: {name} reads a device value on the host"
    if torch.Tag.nondeterministic_seeded in tags and any(
        isinstance(a, torch.Generator) for a in (*args, *kwargs.values())
    ):
        return f"RNG with an explicit generator: {name} (only the default CUDA generator's state is graph-safe)"
    return None


def refusals(facts: CaptureFacts | None, device_type: str, fallback: str | None = None) -> list[str]:
    """Every reason a compiled graph cannot run under CUDA graphs recorded for `device_type`."""
    if facts is None:
        return [f"the graph runs eagerly ({fallback})" if fallback else "the graph runs eagerly"]
    if torch.device(facts.device).type != device_type:
        return [f"the graph runs on {facts.device}, CUDA graphs record {device_type}"]
    found = [f"a {dev.upper()} tensor in the graph (input {k})" for k, dev in facts.other_device_inputs]
    return found + list(facts.extern_refusals)


def static_inputs(gm: torch.fx.GraphModule, kind: str) -> list[int]:
    """Positions of the inputs whose address stays put between calls (AOTAutograd's static inputs):
    parameters and buffers of a forward, every input but the tangents of a backward."""
    if kind == "backward":
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return [k for k, n in enumerate(placeholders) if "tangents" not in n.name]
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    return list(getattr(metadata, "static_input_indices", None) or ())


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


# -- recordings ----------------------------------------------------------------------------------


@dataclass
class Recording:
    index: int  # order of recording in the pool
    kind: str  # the compiled graph's: inference, forward, backward
    graph: Any
    inputs: list  # what the graph reads: static inputs themselves, buffers for the others
    copy_in: list[tuple[int, Any]]  # (input position, index selecting what to copy)
    copy_out: list[int]  # mutated inputs that were copied in: copied back after a replay
    outputs: list  # as recorded: their memory stays allocated while the recording lives
    storages: list[tuple[int, int]]  # (data pointer, bytes) of each pool storage an output views
    handed: list[tuple[int, int, dict]]  # (output position, storage number, tensor metadata)
    live: list[StorageWeakRef] = field(default_factory=list)  # this step's outputs

    def held(self) -> bool:
        return any(not ref.expired() for ref in self.live)

    def hand_out(self, device: torch.device) -> list:
        """The outputs, on storages made for this replay: a later step invalidates these without
        touching the recording's own."""
        storages = [torch._C._construct_storage_from_data_pointer(ptr, device, nbytes) for ptr, nbytes in self.storages]
        self.live = [StorageWeakRef(s) for s in storages]
        out = list(self.outputs)
        for pos, number, meta in self.handed:
            out[pos] = _on_storage(storages[number], meta)
        return out

    def copies(self) -> list:
        """The outputs, copied into fresh tensors of the same layout: what the host program returns."""
        out = list(self.outputs)
        for pos, _, meta in self.handed:
            o = self.outputs[pos]
            out[pos] = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device).copy_(o)
        return out


def _on_storage(storage, meta: dict) -> torch.Tensor:
    make = getattr(torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata", None)
    if make is not None and meta["device"].type == "cuda":
        return make(meta, storage)
    t = torch.empty((0,), dtype=meta["dtype"], device=meta["device"])
    return t.set_(storage, meta["storage_offset"], meta["size"], meta["stride"])


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
    """One memory pool and its step bookkeeping: every graph one recorder records on one device."""

    def __init__(self, recorder: Recorder, device: torch.device):
        self.recorder = recorder
        self.device = device
        self.handle = recorder.new_pool()
        self.recordings: list[Recording] = []  # in the order they were recorded
        self.generation: int | None = None
        self.pending_backward = False  # a forward ran whose backward has not
        # Outputs of earlier steps, with the message reading them will raise: invalidated at the next replay.
        self.stale: list[tuple[StorageWeakRef, str]] = []

    def run(self, fn: Graphed, args: list) -> list:
        self._maybe_begin_step()
        key = fn.key(args)
        rec = fn.recordings.get(key)
        if rec is None:
            rec = self._recording_for(fn, key, args)
            if rec is None:
                return self._plain(fn, args)
        elif self._held_from(rec):
            fn.note_held()
            return self._plain(fn, args)
        return self._replay(fn, rec, args)

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

    def _ran(self, fn: Graphed) -> None:
        if fn.kind == "forward":
            self.pending_backward = True
        elif fn.kind == "backward":
            self.pending_backward = False

    def _plain(self, fn: Graphed, args: list) -> list:
        out = fn.program(args)
        self._ran(fn)
        return out

    def _recording_for(self, fn: Graphed, key: tuple, args: list) -> Recording | None:
        """None: this call runs the host program (a warm-up, or past the bound)."""
        if key not in fn.seen:
            if len(fn.seen) >= fn.max_graphs:
                fn.disable(
                    f"more than cudagraphs_max_graphs={fn.max_graphs} different inputs (shapes, or "
                    "addresses of parameters and other static inputs): it runs without CUDA graphs from here"
                )
                return None
            fn.seen.add(key)
            return None  # warm-up: kernels load and libraries set up outside the capture
        try:
            rec = self._record(fn, args)
        except Exception as e:
            if config.get("strict"):
                raise
            fn.disable(f"its capture failed: {type(e).__name__}: {e}"[:300])
            return None
        fn.recordings[key] = rec
        log.artifact("cudagraphs", f"{fn.kind} graph", f"recorded CUDA graph {rec.index} ({len(fn.recordings)} for it)")
        return rec

    def _record(self, fn: Graphed, args: list) -> Recording:
        inputs, copy_in = [], []
        for k, a in enumerate(args):
            if isinstance(a, torch.Tensor) and k not in fn.static:
                inputs.append(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device))
                copy_in.append((k, _copy_index(a)))
                _copy(inputs[-1], a, copy_in[-1][1])  # the capture sees real values (a fake recorder runs it)
            else:
                inputs.append(a)
        graph, outputs = self.recorder.record(lambda: fn.program(list(inputs)), inputs, self.handle)
        input_storages = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
        storages: dict[int, int] = {}  # data pointer -> number
        sizes: list[tuple[int, int]] = []
        handed = []
        for pos, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor):
                continue
            storage = o.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in input_storages:
                continue  # a view of an input: AOTAutograd remakes it from the caller's tensor
            if ptr not in storages:
                storages[ptr] = len(sizes)
                sizes.append((ptr, storage.nbytes()))
            meta = {
                "nbytes": storage.nbytes(),
                "data_ptr": ptr,
                "size": o.shape,
                "stride": o.stride(),
                "dtype": o.dtype,
                "device": o.device,
                "storage_offset": o.storage_offset(),
            }
            handed.append((pos, storages[ptr], meta))
        copied = {k for k, _ in copy_in}
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
        )
        self.recordings.append(rec)
        return rec

    def _replay(self, fn: Graphed, rec: Recording, args: list) -> list:
        for k, index in rec.copy_in:
            _copy(rec.inputs[k], args[k], index)
        written_back = [(args[k], rec.inputs[k]) for k in rec.copy_out]
        args.clear()  # the boxed convention: the caller's inputs are not kept past this call
        if self.stale:
            for ref, message in self.stale:
                if not ref.expired():
                    self.recorder.invalidate(ref.cdata, message)
            self.stale = []
        self.recorder.replay(rec.graph)
        for original, buffer in written_back:
            original.copy_(buffer)
        self._ran(fn)
        return rec.copies() if fn.copy_outputs else rec.hand_out(self.device)


_pools: dict[tuple[int, str], Pool] = {}


def pool_for(recorder: Recorder, device: torch.device) -> Pool:
    """The one pool of `recorder` on `device`."""
    with _lock:
        key = (id(recorder), str(device))
        pool = _pools.get(key)
        if pool is None or pool.recorder is not recorder:
            pool = _pools[key] = Pool(recorder, device)
        return pool


class Graphed:
    """A compiled graph under CUDA graphs, called by AOTAutograd with a list of inputs."""

    def __init__(
        self,
        program: Callable,
        kind: str,
        static: Sequence[int],
        mutated: Sequence[int],
        pool: Pool,
        symbolic: bool = True,
        copy_outputs: bool = False,
    ):
        self._boxed_call = True  # an instance attribute: see pipeline.CompiledGraph
        self.program = program
        self.report = getattr(program, "report", None)
        self.kind = kind
        self.static = frozenset(static)
        self.symbolic = symbolic
        # The default mode's graphs (setting cudagraphs_default) return copies, and log rather than warn.
        self.copy_outputs = copy_outputs
        self.mutated = tuple(mutated)
        self.pool = pool
        self.max_graphs = config.get("cudagraphs_max_graphs")
        self.recordings: dict[tuple, Recording] = {}
        self.seen: set[tuple] = set()
        self.disabled: str | None = None
        self._held_noted = False

    def __call__(self, args: list) -> list:
        if self.disabled is not None:
            return self.program(args)
        return self.pool.run(self, args)

    def key(self, args: list) -> tuple:
        """What a recording is for: the addresses of static inputs, the strides of the others (a
        backward's gradients may come in any layout), and where sizes vary, every input's shape
        and the integer inputs."""
        static = self.static
        parts: list[Any] = [
            (a.data_ptr() if k in static else a.stride()) if isinstance(a, torch.Tensor) else a
            for k, a in enumerate(args)
        ]
        if self.symbolic:
            parts += [a.shape if isinstance(a, torch.Tensor) else a for a in args]
        return tuple(parts)

    def disable(self, reason: str) -> None:
        """From here on, run without CUDA graphs; one warning says why."""
        self.disabled = reason
        self.recordings.clear()
        if self.report is not None:
            self.report.cudagraphs = f"off: {reason}"
        if self.copy_outputs:
            log.artifact("cudagraphs", f"{self.kind} graph", reason)
        else:
            log.warn(f"ember: a {self.kind} graph: {reason}")

    def note_held(self) -> None:
        if not self._held_noted:
            self._held_noted = True
            log.artifact(
                "cudagraphs",
                f"{self.kind} graph",
                "called again in the same step while an output it could overwrite is still held: that "
                "call ran without its CUDA graph (call torch.compiler.cudagraph_mark_step_begin() "
                "between steps, or drop the outputs before calling again)",
            )


def graphed(
    program: Callable, kind: str, static: Sequence[int], facts: CaptureFacts, default_mode: bool = False
) -> Callable:
    """`program` under CUDA graphs where it can be captured; else `program` itself, with the reason
    logged and in its report. `default_mode`: graphs the caller did not ask for (setting
    cudagraphs_default), whose outputs are copies: only where that saves launches."""
    recorder = current_recorder()
    report = getattr(program, "report", None)
    fallback = getattr(report, "fallback", None)
    reasons = refusals(None if fallback else facts, recorder.device_type, fallback)
    if default_mode and not reasons:
        reasons = _default_mode_refusals(kind, facts, report)
    if reasons:
        why = "; ".join(reasons)
        log.artifact("cudagraphs", f"{kind} graph", f"runs without CUDA graphs: {why}")
        if report is not None:
            report.cudagraphs = f"off: {why}"
        return program
    if report is not None:
        report.cudagraphs = f"on ({len(static)} static inputs)"
    device = torch.device(facts.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    pool = pool_for(recorder, device)
    return Graphed(program, kind, static, facts.mutated_inputs, pool, facts.symbolic, copy_outputs=default_mode)


def _default_mode_refusals(kind: str, facts: CaptureFacts, report) -> list[str]:
    """Why the default mode does not record a graph it could capture: its outputs must be fresh
    tensors, so each costs a copy after the replay; that pays only where it replaces more launches."""
    if kind != "inference":
        return [f"default mode: a {kind} graph (its saved activations would be copied each step)"]
    if facts.symbolic:
        return ["default mode: sizes vary from call to call"]
    launches = len(report.kernels) + len(report.externs) if report is not None else 0
    if launches <= facts.num_outputs:
        return [f"default mode: {launches} launches, {facts.num_outputs} outputs to copy"]
    return []
