"""Compile one ATen graph: the list of passes, and the fail-safe around them.

    import_graph  ATen FX graph -> ember Graph          (frontend/)
    verify        structural checks (EMBER_CHECK=1)      (ir/)
    split         long reductions with few outputs -> two stages  (schedule/split.py)
    schedule      realize, group, fuse, order            (schedule/)
    build         render kernels, run the toolchain      (codegen/ + backends/)
    write_host    the host program that runs it all      (codegen/host.py)

Any exception in any pass makes this graph run eagerly, with one warning naming the cause
(EMBER_STRICT=1 raises instead).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ember import config, log
from ember.report import FusionReport, GraphReport, KernelReport, publish


class CompiledGraph:
    """A compiled graph, called by AOTAutograd with a list of inputs (the boxed convention)."""

    def __init__(self, call: Callable, report: GraphReport):
        # An instance attribute, not a class one: AOTAutograd wraps the backward function with
        # functools.wraps, which copies __dict__ and would drop a class attribute.
        self._boxed_call = True
        self._call = call
        self.report = report

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


def select_backend(device: torch.device):
    choice = config.get("backend")
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "cpp"
    if choice == "triton":
        from ember.backends.triton import TritonBackend

        return TritonBackend()
    if device.type != "cpu":
        raise NotImplementedError(f"the cpp backend runs on CPU tensors, not {device}")
    from ember.backends.cpp import CppBackend

    return CppBackend()


def _check(graph, name: str) -> None:
    from ember.ir.graph import verify

    if config.get("check"):
        verify(graph)
    log.artifact("graph", f"after {name}", lambda: str(graph))


def compile_graph(gm: torch.fx.GraphModule, example_inputs, kind: str) -> Callable:
    from ember.codegen.host import write_host
    from ember.frontend.importer import import_graph
    from ember.schedule.fusion import schedule
    from ember.schedule.kernel import estimate_bytes
    from ember.schedule.split import split_reductions

    start = time.perf_counter()
    report = GraphReport(kind=kind, num_nodes=sum(1 for n in gm.graph.nodes if n.op == "call_function"))
    try:
        device = graph_device(gm, example_inputs)
        graph = import_graph(gm, device)
        _check(graph, "import")
        split_reductions(graph)
        _check(graph, "split_reductions")
        sched = schedule(graph)
        log.artifact(
            "fusion",
            kind,
            "\n".join(
                f"{d.consumer} <- {d.producer}: {'yes' if d.accepted else 'no'}, {d.reason}" for d in sched.decisions
            ),
        )
        backend = select_backend(device)
        report.backend = backend.name
        namespace = backend.build(sched.kernels)
        host = write_host(sched, backend.launch_line)
        host.namespace.update(namespace)
        log.artifact("code", f"{kind} kernels", backend.full_source)
        log.artifact("code", f"{kind} host program", host.source)
        log.artifact("schedule", kind, host.source)
        for k in sched.kernels:
            moved = estimate_bytes(k)
            report.kernels.append(
                KernelReport(
                    k.name, k.origins, str(k.domain), backend.sources[k.name], int(moved) if moved.is_Integer else None
                )
            )
        report.externs = [n.origin for n in sched.externs]
        report.fusion = [FusionReport(d.consumer, d.producer, d.accepted, d.reason) for d in sched.decisions]
        report.host_source = host.source
        result: Callable = CompiledGraph(host.call, report)
    except Exception as e:
        if config.get("strict"):
            raise
        report.fallback = f"{type(e).__name__}: {e}".strip()[:500]
        warnings.warn(f"ember: running a {kind} graph eagerly: {report.fallback}", stacklevel=2)
        result = EagerGraph(gm, report)
    report.compile_seconds = time.perf_counter() - start
    log.summary(report.summary())
    publish(report)
    return result
