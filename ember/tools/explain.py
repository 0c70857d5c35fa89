"""`ember.explain(fn, *args)`: compile and run fn once, forward and backward, and report.

`explain_all` adds what `ember explain` shows: Dynamo's graph breaks, every kernel's code at each layer
(backends/layers.py) and its measured time against the device's ceilings (explain_measure.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.report import ExplainReport, collecting


def _grad_leaves(fn: Callable, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    leaves = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    if isinstance(fn, torch.nn.Module):
        leaves += [p for p in fn.parameters() if p.requires_grad]
    return leaves


def explain(fn: Callable, *args: Any, **kwargs: Any) -> ExplainReport:
    import torch._dynamo

    from ember.frontend.backend import ember_backend

    torch._dynamo.reset()  # a fresh capture, so every graph is compiled (and reported) again
    compiled = torch.compile(fn, backend=ember_backend)
    with collecting() as report:
        out = compiled(*args, **kwargs)
        outputs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        outputs = [o for o in outputs if o.requires_grad]
        leaves = _grad_leaves(fn, args, kwargs)
        if outputs and leaves:
            # torch.autograd.grad leaves .grad untouched: explaining must not change the model.
            torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs], allow_unused=True)
    return report


@dataclass
class Explanation:
    """Everything `ember explain` shows of one function: Dynamo's graph breaks, ember's report of each
    graph, each kernel's layers, and (measured) each kernel's time against the device's ceilings."""

    report: ExplainReport
    breaks: list[str] = field(default_factory=list)  # "reason (file:line: code)"
    recompiles: list[str] = field(default_factory=list)  # each recompile: Dynamo's reason, what ember reused
    dynamo_graphs: int = 0
    dynamo_code: list[str] = field(default_factory=list)  # each graph Dynamo captured, as FX prints its code
    layers: dict[int, dict] = field(default_factory=dict)  # graph index -> kernel name -> KernelLayers
    measured: list = field(default_factory=list)  # explain_measure.Measured
    ceilings: object | None = None  # explain_measure.Ceilings
    title: str = ""


def graph_breaks(fn: Callable, args: tuple, kwargs: dict) -> tuple[int, list[str], list[str]]:
    """(graphs Dynamo captures, each graph break with its reason and user line, each graph's code), from
    torch._dynamo.explain (which runs fn once with a backend of its own)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        out = torch._dynamo.explain(fn)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the breaks are a help; the explanation goes on without them
        return 0, [f"(Dynamo's explain failed: {type(e).__name__}: {str(e)[:200]})"], []
    finally:
        torch._dynamo.reset()
    breaks = []
    for b in out.break_reasons:
        reason = " ".join(str(b.reason).split())[:400]
        where = b.user_stack[-1] if b.user_stack else None
        at = f" at {where.filename}:{where.lineno}: {(where.line or '').strip()}" if where is not None else ""
        breaks.append(reason + at)
    return out.graph_count, breaks, [g.code.strip() for g in out.graphs]


def explain_all(
    fn: Callable,
    args: tuple,
    kwargs: dict | None = None,
    *,
    measure: bool = True,
    calls: int = 5,
    small_ceilings: bool = False,
    title: str = "",
) -> Explanation:
    """Graph breaks, then `explain` (compile, run forward and backward once), every kernel's layers, and
    (with `measure`) every kernel timed over `calls` steps against ceilings measured on this device.
    The steps leave no trace: a module's buffers (batch norm's running statistics) and the random number
    generators are as they were before."""
    kwargs = kwargs or {}
    buffers = [(b, b.detach().clone()) for b in fn.buffers()] if isinstance(fn, torch.nn.Module) else []
    devices = [t.device.index or 0 for t in _tensors(args, kwargs, fn) if t.device.type == "cuda"][:1]
    try:
        with torch.random.fork_rng(devices=devices):
            return _explain_all(fn, args, kwargs, measure, calls, small_ceilings, title)
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _explain_all(fn, args, kwargs, measure, calls, small_ceilings, title) -> Explanation:
    from ember.tools import explain_measure

    count, breaks, code = graph_breaks(fn, args, kwargs)
    import torch._dynamo

    from ember.frontend.backend import ember_backend

    compiled = torch.compile(fn, backend=ember_backend)

    def step():
        out = compiled(*args, **kwargs)
        outputs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        outputs = [o for o in outputs if o.requires_grad]
        leaves = _grad_leaves(fn, args, kwargs) or _leaves_of(outputs)
        if outputs and leaves:
            torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs], allow_unused=True)

    with collecting() as report:
        step()
    result = Explanation(report, breaks=breaks, dynamo_graphs=count, dynamo_code=code, title=title)
    for gi, g in enumerate(report.graphs):
        if g.layers is not None:
            result.layers[gi] = g.layers()
    if measure and report.graphs:
        device = _device_of(args, kwargs, fn)
        dtype = next((a.dtype for a in _tensors(args, kwargs, fn) if a.is_floating_point()), torch.float32)
        result.ceilings = explain_measure.measure_ceilings(device, dtype, small=small_ceilings)
        symbols = {(gi, name): kl.symbol for gi, ls in result.layers.items() for name, kl in ls.items() if kl.symbol}
        result.measured = explain_measure.measure_step(report, step, device, calls, symbols)
    return result


def _leaves_of(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors the outputs' autograd graph accumulates into (a closure's parameters too)."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set = set()
    todo = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves[id(variable)] = variable
        todo += [n for n, _ in node.next_functions]
    return list(leaves.values())


def _tensors(args: tuple, kwargs: dict, fn: Callable) -> list[torch.Tensor]:
    found = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if isinstance(fn, torch.nn.Module):
        found += list(fn.parameters())
    return found


def _device_of(args: tuple, kwargs: dict, fn: Callable) -> torch.device:
    return next((t.device for t in _tensors(args, kwargs, fn)), torch.device("cpu"))


def short_path(where: str) -> str:
    """ "file:line" with the file relative to the working folder where it lies below it."""
    path, _, line = where.rpartition(":")
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{line}"
