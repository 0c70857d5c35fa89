"""CUDA graphs around compiled graphs: `mode="reduce-overhead"`, or `options={"cudagraphs": True}`.

A compiled graph's launches are recorded into a CUDA graph and replayed: a call costs one graph
launch, not one host-side launch per kernel. The rules are those users know from Inductor's CUDA
graph trees (docs/cudagraphs.md says them for users):

- Warm-up: the first call with a given key (the addresses of static inputs, the strides of the
  others, and where sizes vary, every input's shape and the integer inputs) runs the host program
  as usual; the next one records, then replays.
  At most `cudagraphs_max_graphs` keys per compiled graph; past that it runs without CUDA graphs
  and warns once.
- Static inputs (parameters, buffers, a backward's saved tensors: what AOTAutograd marks static)
  are read where they are; so are inputs that live in the pool's memory (outputs of an earlier
  recording: the gradients a recorded backward hands an optimizer step), with their addresses in the
  key, and inputs the program reaches only through address tables (an optimizer step's gradients and
  step counters, read by its table combo kernels), whose tables are rewritten before a replay when
  they come at new addresses. The others are copied into buffers the recording owns.
- One memory pool per device (and recorder) is shared by every recorded graph, the forward and
  backward of a training step among them. A recording's outputs stay allocated, so no later
  recording places anything over them; its temporaries may be reused by later recordings. Once
  every recording of a pool is released, the next capture takes a new pool.
- Outputs live in the pool and the next replay overwrites them. A step begins at
  `torch.compiler.cudagraph_mark_step_begin()`, or at the next torch.compile'd invocation when no
  backward is pending; outputs of earlier steps are then invalidated (reading them raises PyTorch's
  error) before a replay can overwrite them. Within a step, a graph whose replay could overwrite
  an output that is still held (its own, or one of a later recording, which may lie in its
  temporaries) runs without its CUDA graph for that call: fresh outputs, never a silent overwrite.
- Mutated inputs are captured: a static one is written in place by the graph, another is copied
  back after the replay.
- What cannot be captured (`refusals`: CPU tensors, host syncs, data-dependent sizes, RNG with an
  explicit generator, ops marked cudagraph_unsafe, a cond or while_loop whose branch the host picks
  from a device value, anything of these inside a branch or loop body) runs without CUDA graphs and says why
  (EMBER_LOGS=cudagraphs, EMBER_DEBUG=1, the graph's report in ember.explain).

The device calls go through a `Recorder` (pool, record, replay, invalidate): `CudaRecorder` on a
GPU; tests pass a fake one with `use_recorder`, which is how the bookkeeping runs on a CPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from ember import config, log
from ember.runtime.cudagraph_capture import expandable_segments
from ember.runtime.cudagraph_pool import (
    GRADIENT_OVERWRITTEN,
    OVERWRITTEN,
    Pool,
    Recorder,
    pool_for,
    same_addresses,
)
from ember.runtime.cudagraph_recording import Recording

__all__ = ["GRADIENT_OVERWRITTEN", "OVERWRITTEN", "Pool", "Recorder", "capture_facts", "graphed", "use_recorder"]


class CudaRecorder:
    device_type = "cuda"

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def record(self, run: Callable[[], list], inputs: list, pool: Any) -> tuple[Any, list]:
        graph = torch.cuda.CUDAGraph()
        with (
            expandable_segments(config.get("cudagraphs_expandable_pool")),
            torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"),
        ):
            outputs = run()
        return graph, outputs

    def replay(self, graph: Any) -> None:
        graph.replay()

    def invalidate(self, storage: int, message: str) -> None:
        torch._C._set_storage_data_ptr_access_error_msg(storage, message)

    def stream(self) -> Any:
        return torch.cuda.current_stream()

    def time_device(self, run: Callable[[], Any]) -> tuple[Any, float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = run()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end) / 1e3

    def time_host(self, run: Callable[[], Any], what: str) -> tuple[Any, float]:
        start = time.perf_counter()
        result = run()
        return result, time.perf_counter() - start


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
    # The default mode copies the outputs before this position after each replay and hands out the rest
    # (None: copies every one): a training forward's before the tensors it saves for its backward, none of a
    # backward's (its gradients are handed out until one is found held, Pool._copy_held).
    copied_below: int | None = None
    kept_outputs: int = 0  # tensors among those copied
    # The default mode's: the share of a replay's device time its copies may take where the host is not the
    # slower (the target's graphs.default_copy_percent; cudagraph_judge.keep_or_drop).
    copy_share: float = 0.0
    copy_bandwidth: float = 0.0  # the device's, bytes/s (the Target's measured one): what the copies take


def capture_facts(
    gm: torch.fx.GraphModule,
    device: torch.device,
    copied_below: int | None = None,
    copy_share: float = 0.0,
    copy_bandwidth: float = 0.0,
) -> CaptureFacts:
    """The facts of the ATen graph `gm`, compiled for `device`; the others: as CaptureFacts says."""
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
        found = [extern_refusal(node.target, node.args, node.kwargs), _host_result(node, device)]
        for reason in [*found, *_subgraph_refusals(gm, node)]:
            if reason and reason not in reasons:
                reasons.append(reason)
        if node.target is torch.ops.aten.copy_.default and node.args[0] in positions:
            mutated.append(positions[node.args[0]])
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    result = outputs[0].args[0] if outputs else ()
    returned_nodes = list(result) if isinstance(result, (list, tuple)) else [result]
    kept = list(returned_nodes[:copied_below] if copied_below is not None else returned_nodes)
    tensors = [n for n in torch.utils._pytree.tree_leaves(kept) if isinstance(n, torch.fx.Node)]
    return CaptureFacts(
        str(device),
        tuple(others),
        tuple(reasons),
        tuple(mutated),
        symbolic,
        copied_below,
        len(tensors),
        copy_share,
        copy_bandwidth,
    )


# Activation checkpointing saves the generator's state on the host before a random op it will
# recompute (aten/lowerings/rng_state.py): `torch.cuda.get_rng_state` cannot run inside a capture.
_HOST_RNG_STATE_OPS = (run_and_save_rng_state, run_with_rng_state)


def extern_refusal(target: Any, args: Sequence, kwargs: dict) -> str | None:
    """Why an ATen call cannot be captured into a CUDA graph, or None."""
    if target is getattr(torch.ops.higher_order, "while_loop", None):
        return "control flow on the host: torch.while_loop reads its condition on the host every turn"
    if target in _HOST_RNG_STATE_OPS:
        return "the generator's state read or set on the host: activation checkpointing's recomputed random op"
    if target is getattr(torch.ops.higher_order, "cond", None):
        pred = args[0] if args else None
        if isinstance(pred, torch.fx.Node) and isinstance(pred.meta.get("val"), torch.Tensor):
            return "control flow on the host: torch.cond reads its predicate, a device tensor, on the host"
        return None  # a predicate over sizes: the recording is per set of sizes, its branch fixed
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = f"aten.{target._opname}" if target.namespace == "aten" else str(target)
    tags = set(target.tags)
    if getattr(torch.Tag, "cudagraph_unsafe", None) in tags:
        return f"{name} is marked cudagraph_unsafe"
    if torch.Tag.dynamic_output_shape in tags and not _integer_indexing(target, args):
        return f"data-dependent sizes: {name}"
    if torch.Tag.data_dependent_output in tags:
        return f"a sync: {name} reads a device value on the host"
    if torch.Tag.nondeterministic_seeded in tags and any(
        isinstance(a, torch.Generator) for a in (*args, *kwargs.values())
    ):
        return f"RNG with an explicit generator: {name} (only the default CUDA generator's state is graph-safe)"
    return None


def _host_result(node: torch.fx.Node, device: torch.device) -> str | None:
    """A CPU tensor computed inside a device graph (DeBERTa's `torch.tensor(d).sqrt()`): the host
    computes it, and its copy to the device reads pageable host memory, which a capture cannot."""
    if device.type == "cpu":
        return None
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (list, tuple)) else [vals]
    if any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in vals):
        name = getattr(node.target, "__name__", str(node.target))
        return f"a CPU tensor computed in the graph ({name})"
    return None


def _integer_indexing(target: Any, args: Sequence) -> bool:
    """aten.index with integer index tensors only: its size follows from the indices' sizes. The
    op is tagged with data-dependent sizes for boolean indices (`x[x > 0]`), whose count of True
    entries sizes the result."""
    if target is not torch.ops.aten.index.Tensor or len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return False
    indices = [i for i in args[1] if i is not None]
    values = [i.meta.get("val") if isinstance(i, torch.fx.Node) else i for i in indices]
    return bool(values) and all(
        isinstance(v, torch.Tensor)
        and v.device.type != "cpu"  # a host index is copied to the device inside the op
        and not v.is_floating_point()
        and v.dtype not in (torch.bool, torch.uint8)
        for v in values
    )


def _subgraph_refusals(gm: Any, node: torch.fx.Node) -> list[str]:
    """The refusals of what a higher-order op's branches or body call (a sync inside a cond branch)."""
    found = []
    for arg in node.args:
        sub = getattr(gm, arg.target, None) if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" else None
        if isinstance(sub, torch.fx.GraphModule):
            for inner in sub.graph.nodes:
                if inner.op == "call_function":
                    found += [extern_refusal(inner.target, inner.args, inner.kwargs), *_subgraph_refusals(sub, inner)]
    return [r for r in found if r]


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


def copied_below(kind: str) -> int | None:
    """CaptureFacts.copied_below for a graph of this kind: a training forward's outputs before the
    tensors it saves for its backward (AOTAutograd's effect tokens, then its mutated inputs, user outputs,
    their bases and an RNG offset; None where AOTAutograd does not say), 0 for a backward, None for an
    inference graph. (The constant fold keeps these outputs computed: frontend/constant_fold.py.)
    A wrong count costs speed, not a wrong answer: an output the caller keeps but counted as saved is
    handed out, tracked as every handed-out tensor is, and while held keeps the graph from replaying;
    a saved one counted as returned is copied."""
    if kind == "backward":
        return 0
    if kind != "forward":
        return None
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    count = getattr(metadata, "num_forward", None)
    return count + len(getattr(metadata, "tokens", None) or ()) if isinstance(count, int) else None


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
        *,
        default_mode: bool = False,
        copied_below: int | None = None,
        copy_share: float = 0.0,
        copy_bandwidth: float = 0.0,
    ):
        self._boxed_call = True  # an instance attribute: see pipeline.CompiledGraph
        self.program = program
        self.report = getattr(program, "report", None)
        # The schedule AOTAutograd's cache may keep (frontend/aot_cache.py takes it from here).
        self.kept, program.kept = getattr(program, "kept", None), None
        self.kind = kind
        self.static = frozenset(static)
        self.table_inputs = frozenset(getattr(program, "table_inputs", ()))
        self.table_rows = getattr(program, "table_rows", 0)
        self.symbolic = symbolic
        # The default mode's graphs (setting cudagraphs_default) return copies of what the caller keeps
        # (CaptureFacts.copied_below) and log rather than warn.
        self.default_mode = default_mode
        self.handed_from = copied_below if default_mode else 0
        self.copy_share, self.copy_bandwidth = copy_share, copy_bandwidth  # cudagraph_judge.keep_or_drop
        self.host_seconds: dict[tuple, float] = {}
        self.host_timed: dict[tuple, int] = {}
        self.mutated = tuple(mutated)
        self.pool = pool
        self.max_graphs = config.get("cudagraphs_max_graphs")
        self.recordings: dict[tuple, Recording] = {}
        self.last: Recording | None = None  # the last one replayed: tried first
        self.seen: set[tuple] = set()
        self.short_lived = 0
        self.disabled: str | None = None
        self._noted: set[str] = set()  # what _note_once has logged
        # When this graph is dropped (Dynamo's cache reset, the model deleted), its recordings' CUDA graphs
        # and memory go back to the pool; the callback holds the recordings, not this object.
        weakref.finalize(self, _release, pool, self.recordings)

    def __call__(self, args: list) -> list:
        if self.disabled is not None:
            return self.program(args)
        return self.pool.run(self, args)

    def find(self, args: list) -> tuple[tuple | None, Recording | None]:
        """(the key of this call, or None where the last recording replayed matches and the pool's memory
        is as it was when a key last named it; its recording)."""
        last = self.last
        if (
            last is not None
            and not self.symbolic
            and last.checked == self.pool.changes
            and same_addresses(args, last.addresses, last.static_tensors)
            # Table inputs that moved take the key: one in the pool's memory may now lie in the memory this
            # recording's temporaries take, which only a capture that saw it live keeps apart.
            and (not last.rebound or same_addresses(args, last.bound, last.rebound))
            and all(args[k].stride() == stride for k, stride in last.strides)
        ):
            return None, last
        key = self.key(args)
        return key, self.recordings.get(key)

    def key(self, args: list) -> tuple:
        """What a recording is for: the addresses of static inputs, the strides of the others (a
        backward's gradients may come in any layout), with the address of those that live in the
        pool's memory (an earlier recording's outputs, read where they are), and where sizes vary,
        every input's shape and the integer inputs."""
        static = self.static
        resident = self.pool.resident()

        def part(k: int, a: Any) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            if k in static:
                return a.data_ptr()
            if a.untyped_storage().data_ptr() in resident:
                return a.stride(), a.data_ptr()
            return a.stride()

        parts: list[Any] = [part(k, a) for k, a in enumerate(args)]
        if self.symbolic:
            parts += [a.shape if isinstance(a, torch.Tensor) else a for a in args]
        return tuple(parts)

    def disable(self, reason: str) -> None:
        """From here on, run without CUDA graphs; one warning says why."""
        self.disabled = reason
        self.pool.release(list(self.recordings.values()))
        self.recordings.clear()
        self.last = None
        if self.report is not None:
            self.report.cudagraphs = f"off: {reason}"
        if self.default_mode:
            log.artifact("cudagraphs", f"{self.kind} graph", reason)
        else:
            article = "an" if self.kind[:1] in "aeiou" else "a"
            log.warn(f"ember: {article} {self.kind} graph: {reason}")

    def _note_once(self, what: str, text: str) -> None:
        """Log `text` for this graph the first time `what` happens."""
        if what not in self._noted:
            self._noted.add(what)
            log.artifact("cudagraphs", f"{self.kind} graph", text)

    def note_held(self) -> None:
        advice = (
            ""
            if self.default_mode
            else " (call torch.compiler.cudagraph_mark_step_begin() between steps, or drop the outputs "
            "before calling again)"
        )
        when = "" if self.default_mode else " in the same step"
        self._note_once(
            "held",
            f"called again{when} while an output it could overwrite is still held: that call ran without "
            f"its CUDA graph{advice}",
        )

    def note_other_stream(self) -> None:
        self._note_once(
            "stream",
            "called on another stream than the one the default mode's recordings replay on: that call ran "
            "without its CUDA graph",
        )

    def note_unsuited(self) -> None:
        self._note_once(
            "unsuited",
            "an input read through an address table came at an address its recorded kernel form does not "
            "allow (not 16-byte aligned): that call ran without its CUDA graph",
        )


def _release(pool: Pool, recordings: dict) -> None:
    pool.release(list(recordings.values()))


def graphed_as_set(program: Callable, kind: str, capture: tuple | None) -> Callable:
    """`program` under CUDA graphs as the settings in force ask: every graph under `cudagraphs`, the
    default mode's under `cudagraphs_default`. `capture`: (static input positions, CaptureFacts), or
    None where no CUDA graph may record it."""
    if capture is None or not (config.get("cudagraphs") or config.get("cudagraphs_default")):
        return program
    return graphed(program, kind, *capture, default_mode=not config.get("cudagraphs"))


def graphed(
    program: Callable, kind: str, static: Sequence[int], facts: CaptureFacts, default_mode: bool = False
) -> Callable:
    """`program` under CUDA graphs where it can be captured; else `program` itself, with the reason
    logged and in its report. `default_mode`: graphs the caller did not ask for (setting
    cudagraphs_default), which return copies of what the caller keeps: only where that saves launches,
    and never for a graph on another device than the recorder's (nothing to say of a CPU graph)."""
    recorder = current_recorder()
    if default_mode and torch.device(facts.device).type != recorder.device_type:
        return program
    report = getattr(program, "report", None)
    fallback = getattr(report, "fallback", None)
    reasons = refusals(None if fallback else facts, recorder.device_type, fallback)
    if default_mode and not reasons:
        reasons = _default_mode_refusals(facts, report)
    if reasons:
        why = "; ".join(reasons)
        log.artifact("cudagraphs", f"{kind} graph", f"runs without CUDA graphs: {why}")
        if report is not None:
            report.cudagraphs = f"off: {why}"
        return program
    if report is not None:
        tabled = set(getattr(program, "table_inputs", ())) - set(static)
        through = (
            f", up to {len(tabled)} read through address tables" if tabled and recorder.device_type == "cuda" else ""
        )
        copies = ""
        if default_mode:
            copies = ", gradients handed out" if facts.copied_below == 0 else ", what the caller keeps copied"
        report.cudagraphs = f"on ({len(static)} static inputs{through}{copies})"
    device = torch.device(facts.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    pool = pool_for(recorder, device, with_steps=not default_mode)
    return Graphed(
        program,
        kind,
        static,
        facts.mutated_inputs,
        pool,
        facts.symbolic,
        default_mode=default_mode,
        copied_below=facts.copied_below,
        copy_share=facts.copy_share,
        copy_bandwidth=facts.copy_bandwidth,
    )


def _default_mode_refusals(facts: CaptureFacts, report) -> list[str]:
    """Why the default mode does not record a graph it could capture: what its caller keeps must be
    fresh tensors, so a replay is followed by a copy of them; that pays only where it replaces more
    launches than there are tensors to copy. A training forward's saved tensors are not copied: only
    its backward reads them, and a replay that could write over one still held (two forwards before
    a backward) runs without the graph."""
    if facts.symbolic:
        return ["default mode: sizes vary from call to call"]
    # (A folded constant is an extern that launches nothing: frontend/constant_fold.py.)
    externs = [e for e in report.externs if not e.startswith("constant ")] if report is not None else []
    launches = len(report.kernels) + len(externs) if report is not None else 0
    if launches <= facts.kept_outputs:
        return [f"default mode: {launches} launches, {facts.kept_outputs} outputs to copy"]
    return []
