"""Compile one ATen graph: the list of passes, and the fail-safe around them.

    select_backend  the code generator, and its Target: what every pass is told  (backends/, target.py)
    (schedule cache: a graph scheduled before loads its schedule, skipping the next seven; runtime/)
    import_graph  ATen FX graph -> ember Graph          (aten/)
    verify        structural checks (EMBER_CHECK=1)      (ir/)
    dce           nodes nothing reads, dropped            (ir/dce.py)
    cse           a computation written twice, kept once (ir/cse.py)
    pad           aligned matrix-product layouts        (schedule/padding.py)
    split         long reductions with few outputs -> two stages  (schedule/split.py)
    schedule      realize, group, fuse, order            (schedule/)
    build         render kernels, run the toolchain      (codegen/ + backends/)
    write_host    the host program that runs it all      (codegen/host.py)

Any exception in any pass makes this graph run eagerly, with one warning naming the cause
(EMBER_STRICT=1 raises instead).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from ember import config, faults, log, progress
from ember.backends.base import Backend
from ember.backends.layers import format_layers, kernel_layers
from ember.report import FusionReport, GraphReport, KernelReport, publish
from ember.signals import dynamo_control_flow
from ember.target import Target


class CompiledGraph:
    """A compiled graph, called by AOTAutograd with a list of inputs (the boxed convention)."""

    def __init__(
        self, call: Callable, report: GraphReport, table_inputs: frozenset[int] = frozenset(), table_rows: int = 0
    ):
        # An instance attribute, not a class one: AOTAutograd wraps the backward function with
        # functools.wraps, which copies __dict__ and would drop a class attribute.
        self._boxed_call = True
        self._call = call
        self.report = report
        self.table_inputs = table_inputs  # codegen/host.py: HostProgram.table_inputs
        self.table_rows = table_rows  # codegen/host.py: HostProgram.table_rows
        self.kept = None  # compile_graph(keep_schedule=True): a KeptSchedule, for AOTAutograd's cache

    def __call__(self, args: list) -> list:
        return self._call(args)


class EagerGraph:
    """The fallback: run the ATen graph op by op."""

    def __init__(self, gm: torch.fx.GraphModule, report: GraphReport):
        self._boxed_call = True
        self.gm = gm
        self.report = report

    def __call__(self, args: list) -> Any:
        return self.gm(*args)


def graph_device(gm: torch.fx.GraphModule, example_inputs) -> torch.device:
    """The device ember generates code for: the first CUDA tensor's, else CPU."""
    devices = [x.device for x in example_inputs if isinstance(x, torch.Tensor)]
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            devices.append(val.device)
    for d in devices:
        if d.type == "cuda":
            return d
    return devices[0] if devices else torch.device("cpu")


def select_backend(device: torch.device) -> Backend:
    """The backend the setting `backend` names for `device` (auto: Triton on a GPU, C++ on the CPU)."""
    choice = config.get("backend")
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "cpp"
    if choice == "triton":
        from ember.backends.triton import TritonBackend

        return TritonBackend(device)
    if device.type != "cpu":
        raise NotImplementedError(f"the cpp backend runs on CPU tensors, not {device}")
    from ember.backends.cpp import CppBackend

    return CppBackend()


def _check(graph, name: str) -> None:
    from ember.ir.graph import verify

    if config.get("check"):
        verify(graph)
    log.artifact("graph", f"after {name}", lambda: str(graph))


def _report_schedule(report: GraphReport, sched, backend: Backend, target: Target) -> None:
    """Each kernel's cost (bytes, FLOPs, roofline estimate), the fusion decisions, the memory plan."""
    from ember.schedule import collectives
    from ember.schedule.cost import as_number, bound, estimate_seconds, kernel_cost
    from ember.schedule.memory import describe_mutations

    report.target = str(target)
    for k in sched.kernels:
        cost = sched.costs.get(k.name)
        if cost is None:  # a schedule made elsewhere than _schedule
            cost = kernel_cost(k)
        moved, flops = as_number(cost.bytes), as_number(cost.flops)
        seconds = estimate_seconds(cost, target)
        report.kernels.append(
            KernelReport(
                k.name,
                k.origins,
                str(k.domain),
                backend.sources.get(k.name, "(not generated: every output is empty)"),
                None if moved is None else int(moved),
                None if flops is None else int(flops),
                None if seconds is None else seconds * 1e6,
                bound(cost, target),
                _lines(report, getattr(k, "fx_nodes", [])),
            )
        )
    report.externs = [n.origin for n in sched.externs]
    report.extern_lines = [(_lines(report, [getattr(n, "fx_node", "")]) or [""])[0] for n in sched.externs]
    report.fusion = [FusionReport(d.consumer, d.producer, d.accepted, d.reason, d.saved_bytes) for d in sched.decisions]
    report.memory = str(sched.memory)
    report.peak_bytes, report.eager_peak_bytes = sched.memory.peak_bytes, sched.memory.eager_peak_bytes
    report.mutations = describe_mutations(sched.graph, sched.steps, sched.memory)
    report.collectives = collectives.describe(sched.steps)


def _lines(report: GraphReport, fx_nodes: list[str]) -> list[str]:
    return list(dict.fromkeys(report.node_lines[n] for n in fx_nodes if n in report.node_lines))


def source_lines(report: GraphReport, gm: torch.fx.GraphModule) -> None:
    """The ATen graph's code, and the user's source lines of it into the report: each line's code and
    the ATen ops it became, and each FX node's line. Read from the graph at hand, not kept in a cached
    schedule: the same graph may come from other lines."""
    from ember.aten.builder import op_name

    report.aten_graph = gm.code.strip()

    for node in gm.graph.nodes:
        if node.op == "call_function":
            where, code = log.innermost_frame(node.meta.get("stack_trace") or "")
            if where:
                report.node_lines[node.name] = where
                ops = report.source_lines.setdefault(where, (code, []))[1]
                if op_name(node.target) not in ops:
                    ops.append(op_name(node.target))


def _fusion_log(report: GraphReport) -> str:
    lines = [f"target {report.target}; {report.memory}"]
    lines += [f"kernel {k}" for k in report.kernels]
    lines += [str(f) for f in report.fusion]
    return "\n".join(lines)


class _StageClock:
    """Records the seconds since the previous stage ended under each stage's name."""

    def __init__(self, into: dict[str, float], start: float):
        self.into, self.last = into, start

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = self.into.get(name, 0.0) + now - self.last
        self.last = now


# A training step's two graphs name their kernels apart, so a profile says which graph ran each.
KERNEL_PREFIX = {"inference": "k", "forward": "fk", "backward": "bk"}


def _schedule(gm: torch.fx.GraphModule, device: torch.device, kind: str, backend: Backend, target: Target, stage):
    """Import through scheduling: the ATen graph -> a Schedule (what runtime/schedule_cache.py keeps)."""
    from ember.aten.importer import import_graph
    from ember.ir.cse import eliminate_common_subexpressions
    from ember.ir.dce import eliminate_dead_nodes
    from ember.schedule.cost import kernel_cost
    from ember.schedule.memory import eager_peak as eager_peak_bytes
    from ember.schedule.padding import pad_matmul_layouts
    from ember.schedule.product_bias import products_bias_as_add
    from ember.schedule.scheduler import schedule
    from ember.schedule.skinny import group_skinny_products
    from ember.schedule.split import split_reductions

    faults.at("schedule")
    graph = import_graph(gm, device, compile_subgraph=_subgraph_compiler(kind), lower=target.heuristics.lower)
    _check(graph, "import")
    stage("import")
    eager_peak = eager_peak_bytes(graph)  # before any pass changes what eager would allocate
    dead = eliminate_dead_nodes(graph)
    log.artifact("graph", f"{kind} dead code", lambda: f"{dead} dead node(s) dropped")
    _check(graph, "dce")
    merged = eliminate_common_subexpressions(graph)
    log.artifact("graph", f"{kind} common subexpressions", lambda: f"{merged} duplicate node(s) merged")
    _check(graph, "cse")
    stage("cse")
    biases = products_bias_as_add(graph, target)
    log.artifact("schedule", f"{kind} product biases as adds", lambda: "\n".join(biases) or "none")
    _check(graph, "product_bias")
    grouped = group_skinny_products(graph, target)
    log.artifact("schedule", f"{kind} grouped skinny products", lambda: "\n".join(grouped) or "none")
    _check(graph, "skinny")
    padded = pad_matmul_layouts(graph, target, keep_outputs_dense=kind != "inference")
    log.artifact("schedule", f"{kind} padded layouts", lambda: "\n".join(padded) or "none")
    stage("pad")
    split_reductions(graph, target)
    _check(graph, "split_reductions")
    stage("split")
    sched = schedule(
        graph, eager_peak, target=target, gemm=backend.gemm_chooser, kernel_prefix=KERNEL_PREFIX.get(kind, "k")
    )
    sched.costs = {k.name: kernel_cost(k) for k in sched.kernels}  # for the report, kept with the schedule
    stage("schedule")
    return sched


def _subgraph_compiler(kind: str) -> Callable:
    """How the importer compiles a cond branch or loop body of a `kind` graph: as a graph of its own,
    with its own fallback (aten/lowerings/control_flow.py)."""

    def compile_subgraph(gm: torch.fx.GraphModule, what: str) -> Callable:
        return compile_graph(gm, [], f"{kind} {what}")

    return compile_subgraph


def compile_graph(gm: torch.fx.GraphModule, example_inputs, kind: str, keep_schedule: bool = False) -> Callable:
    """`keep_schedule`: leave the schedule's pickle, device and target on the result as `kept`
    (a KeptSchedule), for AOTAutograd's cache (frontend/aot_cache.py), where the schedule could be cached.
    A compile that takes long reports its stages (ember/progress.py)."""
    with progress.compiling(lambda: f"{kind} graph ({sum(n.op == 'call_function' for n in gm.graph.nodes)} ATen ops)"):
        return _compile_graph(gm, example_inputs, kind, keep_schedule)


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, kind: str, keep_schedule: bool) -> Callable:
    from ember.runtime.schedule_cache import KeptSchedule, schedule_key
    from ember.runtime.schedule_cache import load as load_schedule
    from ember.runtime.schedule_cache import save as save_schedule

    start = time.perf_counter()
    report = GraphReport(kind=kind, num_nodes=sum(1 for n in gm.graph.nodes if n.op == "call_function"))
    source_lines(report, gm)
    stage = _StageClock(report.stage_seconds, start)
    try:
        device = graph_device(gm, example_inputs)
        backend = select_backend(device)
        report.backend = backend.name
        target = backend.target()  # what every pass is told, and what the schedule is made for
        stage("backend")  # imports the toolchain and queries the device on first use
        progress.stage(f"{kind}: scheduling")
        key = schedule_key(gm, kind, target.key())
        loaded = load_schedule(key) if key is not None else None
        if loaded is not None:
            sched, blob = loaded
            _check(sched.graph, "cached schedule")
            stage("cached schedule")
            log.artifact("cache", f"{kind} schedule", "loaded: import through scheduling skipped")
        else:
            sched = _schedule(gm, device, kind, backend, target, stage)
            blob = save_schedule(key, sched) if key is not None else None
            if key is not None:
                stage("cache write")
        result: Callable = _finish(sched, backend, target, kind, report, stage)
        if keep_schedule and blob is not None:
            result.kept = KeptSchedule(blob, str(device), target.key())
    except dynamo_control_flow():
        raise  # PyTorch's own control flow, in every mode: not a failure to fall back from
    except Exception as e:
        if config.get("strict"):
            raise
        result = _fallback(gm, kind, report, e)
    return _published(result, report, start)


def compile_from_schedule(
    sched,
    kind: str,
    device: torch.device,
    num_nodes: int,
    load_seconds: float,
    made_for: tuple,
    publish: bool = True,
) -> Callable:
    """A graph whose schedule came from AOTAutograd's cache (frontend/aot_cache.py): build and
    write the host program, as compile_graph does after scheduling. `load_seconds`: the time the
    schedule took to load, reported as its stage. No fallback: a failure here is AOTAutograd's to
    handle (it compiles the graph anew). `publish`: False leaves the report to publish_loaded,
    once every graph of the compile has loaded."""
    start = time.perf_counter() - load_seconds
    report = GraphReport(kind=kind, num_nodes=num_nodes)
    stage = _StageClock(report.stage_seconds, time.perf_counter())
    backend = select_backend(device)
    report.backend = backend.name
    target = backend.target()
    if target.key() != tuple(made_for):
        raise RuntimeError(f"the schedule was made for the target {made_for}, this one is {target.key()}")
    stage("backend")
    report.stage_seconds["cached schedule"] = load_seconds
    _check(sched.graph, "cached schedule")
    log.artifact("cache", f"{kind} schedule", "loaded from AOTAutograd's cache: tracing through scheduling skipped")
    program = _finish(sched, backend, target, kind, report, stage)
    if not publish:
        report.compile_seconds = time.perf_counter() - start
        return program
    return _published(program, report, start)


def publish_loaded(programs: list) -> None:
    """Publish the reports of graphs loaded from AOTAutograd's cache, once all of them loaded."""
    for program in programs:
        log.summary(program.report.summary())
        publish(program.report)


def _finish(sched, backend: Backend, target: Target, kind: str, report: GraphReport, stage) -> CompiledGraph:
    """Build the kernels and write the host program of a schedule; fill the report."""
    from ember.codegen.host import write_host

    kernels = sum(1 for k in sched.kernels if not k.writes_nothing)
    progress.stage(f"{kind}: building {kernels} kernel{'s' if kernels != 1 else ''}")
    namespace = backend.build([k for k in sched.kernels if not k.writes_nothing], sched.memory)
    if any(n.origin.startswith("flex_attention") for n in sched.externs):
        from ember.backends.flex import build_flex_kernels

        build_flex_kernels(sched, target)  # FlexAttention's flash-attention kernels
    if any(n.origin == "skinny_products" for n in sched.externs):
        from ember.backends.skinny import build_skinny_kernels

        build_skinny_kernels(sched, target)  # grouped products of few rows, one launch each
    progress.kernels_built(kind, kernels)
    stage("build")
    # Dynamo guards the strides of a forward graph's inputs; a backward graph's saved tensors
    # come from ember's forward, and a cond branch's or loop body's operands from the graph around it,
    # whose layouts need not be the ones AOTAutograd recorded.
    host = write_host(sched, backend, check_input_layouts=kind not in ("inference", "forward"))
    host.namespace.update(namespace)
    log.generated_source(f"{kind} kernels", backend.full_source, backend.sources.values())
    log.artifact("code", f"{kind} host program", host.source)
    log.artifact("schedule", kind, host.source)
    _report_schedule(report, sched, backend, target)
    log.artifact("fusion", kind, lambda: _fusion_log(report))
    report.host_source = host.source
    built = [k for k in sched.kernels if not k.writes_nothing]
    report.layers = functools.partial(kernel_layers, backend, built)
    report.namespace = host.namespace
    log.artifact("asm", f"{kind} kernels", lambda: format_layers(report.layers(), machine_only=True))
    stage("host")
    return CompiledGraph(host.call, report, host.table_inputs, host.table_rows)


def _fallback(gm: torch.fx.GraphModule, kind: str, report: GraphReport, e: Exception) -> EagerGraph:
    report.fallback = f"{type(e).__name__}: {e}".strip()[:500]
    article = "an" if kind[:1] in "aeiou" else "a"
    log.warn(f"ember: running {article} {kind} graph eagerly: {report.fallback}")
    return EagerGraph(gm, report)


def _published(result: Callable, report: GraphReport, start: float) -> Callable:
    report.compile_seconds = time.perf_counter() - start
    log.summary(report.summary())
    publish(report)
    return result
