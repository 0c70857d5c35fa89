"""Running one (op, dtype): every sample compiled in one fullgraph batch, re-run one by one to attribute."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ember.frontend.backend import register
from ember.tools.opinfo.comparison import REF_DTYPE, UNINITIALIZED, blank_uninitialized, compare, oneline, structure
from ember.tools.opinfo.samples import (
    Sample,
    SweepTimeout,
    copy_case,
    cotangents,
    diff_outputs,
    grad_leaves,
    reference,
    run_eager,
)
from ember.tools.opinfo.selection import settle


class _Runner:
    """Compiles a function that runs some samples, and checks them."""

    def __init__(self, op, dtype: torch.dtype, device: str, seed: int):
        self.op, self.dtype, self.device, self.seed = op, dtype, device, seed

    def run(self, samples: list[Sample], fullgraph: bool, backend: str | None = None) -> tuple[list, list, Any]:
        """Compiled outputs and gradients of each sample, and the collected ember reports."""
        import torch._dynamo

        from ember.report import collecting

        op = self.op
        cases = [copy_case(s.case) for s in samples]

        def run_samples():
            return [op(c[0], *c[1], **c[2]) for c in cases]

        torch._dynamo.reset()
        compiled = torch.compile(run_samples, backend=backend or register(), dynamic=False, fullgraph=fullgraph)
        with collecting() as report:
            torch.manual_seed(self.seed)
            outs = [settle(op, out) for out in compiled()]
            grads: list = [None] * len(samples)
            all_outs, all_cots, all_leaves, spans = [], [], [], []
            for k, (s, out, case) in enumerate(zip(samples, outs, cases)):
                if s.eager_grads is None:
                    continue
                out_g = s.process_grad(out) if s.process_grad is not None else out
                d_outs, leaves = diff_outputs(out_g), grad_leaves(case)
                spans.append((k, len(all_leaves), len(leaves)))
                all_outs += d_outs
                all_cots += cotangents(d_outs, self.seed)
                all_leaves += leaves
            if all_outs and all_leaves:
                flat = torch.autograd.grad(all_outs, all_leaves, all_cots, allow_unused=True)
                for k, start, n in spans:
                    grads[k] = list(flat[start : start + n])
        outs = [pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, o) for o in outs]
        return outs, grads, report

    def check(self, s: Sample, out, grads) -> str | None:
        if s.random or self.op.name in UNINITIALIZED:
            if structure(out) != structure(s.eager):
                return f"output structure {structure(out)}, eager {structure(s.eager)}"
            return None
        name = self.op.name
        ref_fn = (
            (lambda: blank_uninitialized(name, reference(self.op, s, self.dtype, False, self.seed)))
            if self.dtype in REF_DTYPE
            else None
        )
        out, eager = blank_uninitialized(self.op.name, out), blank_uninitialized(self.op.name, s.eager)
        why = compare(out, eager, ref_fn, self.dtype)
        if why is not None or s.eager_grads is None:
            return why
        if grads is None:
            return "no gradients from the compiled call"
        gref = (lambda: reference(self.op, s, self.dtype, True, self.seed)) if self.dtype in REF_DTYPE else None
        e_grads = [torch.zeros(0) if g is None else g for g in s.eager_grads]
        a_grads = [torch.zeros(0) if g is None else g.detach() for g in grads]
        return compare(a_grads, e_grads, gref, self.dtype, what="grad")


# Samples run alone before a batch that reached ember with no graph settles the rest as `fallback`.
SHORTCUT_PROBES = 8


def _no_graph_shortcut(runner: _Runner, todo: list[Sample]) -> list[Sample]:
    """After a failed fullgraph batch: if Dynamo hands ember no graph at all for the batch (data-dependent
    ops such as unique or nonzero break the graph), every sample that matches is `fallback` at once,
    instead of tracing each alone. Returns the samples left to run one by one.

    A graph break inside the batch can make Dynamo run the whole batch eagerly while samples alone
    still compile (boolean-mask `__getitem__` among plain indexing), so a few samples are first run
    alone: if one reaches ember, every sample is run alone."""
    try:
        outs, grads, report = runner.run(todo, fullgraph=False)
    except SweepTimeout:
        raise
    except Exception:  # noqa: BLE001  (the one-by-one runs record the error)
        return todo
    if report.graphs or _some_alone_reach_ember(runner, todo[:SHORTCUT_PROBES]):
        return todo
    rest = []
    for s, out, g in zip(todo, outs, grads):
        if runner.check(s, out, g) is None:
            s.finish("fallback", "Dynamo: no graph reached ember")
        else:
            rest.append(s)
    return rest


def _some_alone_reach_ember(runner: _Runner, samples: list[Sample]) -> bool:
    for s in samples:
        try:
            _, _, report = runner.run([s], fullgraph=False)
        except SweepTimeout:
            raise
        except Exception:  # noqa: BLE001  (an error alone: the one-by-one runs record it)
            return True
        if report.graphs:
            return True
    return False


def _fallbacks(report) -> list[str]:
    return [f"{g.kind}: {g.fallback}" for g in report.graphs if g.fallback]


# Exceptions by which ember declines a graph on purpose; any other exception that its fail-safe
# caught (ZeroDivisionError, KeyError, a compiler error on generated code, ...) is a bug: `crash`.
DELIBERATE = ("GraphUnsupported", "NotImplementedError")


def _deliberate(fallback: str) -> bool:
    return fallback.split(": ", 2)[1] in DELIBERATE if fallback.count(": ") >= 2 else False


def _pytorch_cannot_trace(runner: _Runner, s: Sample, errors: list[str]) -> bool:
    """Every error is AOTAutograd failing to trace (before any ember pass), and PyTorch's own
    `aot_eager` backend fails on the sample too: a PyTorch limitation, which ember ran eagerly."""
    if not all(e.count(": ") >= 2 and e.split(": ", 2)[1] == "AOTAutograd" for e in errors):
        return False
    return _fails_with(runner, s, "aot_eager")


def _dynamo_cannot_trace(runner: _Runner, s: Sample) -> bool:
    """The compiled call raised, and so does torch.compile with PyTorch's own `eager` backend: Dynamo
    fails on the sample before any backend sees it (eager's `x.addbmm_(...)` resizes a one-element
    `x`, which Dynamo's fake tensors refuse), so no backend could run it."""
    return _fails_with(runner, s, "eager")


def _fails_with(runner: _Runner, s: Sample, backend: str) -> bool:
    """Whether torch.compile with PyTorch's own `backend` raises on the sample."""
    try:
        runner.run([s], fullgraph=False, backend=backend)
    except SweepTimeout:
        raise
    except Exception:  # noqa: BLE001  (that failure is the evidence)
        return True
    return False


def run_pair(
    op, dtype: torch.dtype, device: str, *, limit: int | None, grad_dtypes, seed: int = 0, into: list | None = None
) -> list[Sample]:
    """Every sample of one op in one dtype, each with its outcome.

    The samples are also appended to `into` as soon as they exist, so that a caller whose alarm
    interrupts the run (SweepTimeout) still has them.
    """
    want_grad = op.supports_autograd and dtype in grad_dtypes
    torch.manual_seed(seed)
    raw = list(op.sample_inputs(device, dtype, requires_grad=want_grad))
    if limit is not None:
        raw = raw[:limit]
    samples = [Sample(i, (r.input, tuple(r.args), dict(r.kwargs)), r.output_process_fn_grad) for i, r in enumerate(raw)]
    if into is not None:
        into.extend(samples)
    todo = []
    for s in samples:
        try:
            run_eager(op, s, want_grad, seed)
            todo.append(s)
        except SweepTimeout:
            raise
        except Exception as e:  # noqa: BLE001  (eager raises: the sample is not counted)
            s.outcome, s.reason = "skipped", f"eager raises {type(e).__name__}: {oneline(str(e))[:200]}"
    runner = _Runner(op, dtype, device, seed)
    one_by_one = todo
    if len(todo) > 1:
        one_by_one = []
        try:
            outs, grads, report = runner.run(todo, fullgraph=True)
            batch_ok = report.graphs and not _fallbacks(report)
        except SweepTimeout:
            raise
        except Exception:  # noqa: BLE001  (re-run one by one, which records the error)
            batch_ok = False
        if batch_ok:
            for s, out, g in zip(todo, outs, grads):
                why = runner.check(s, out, g)
                if why is None:
                    s.finish("match")
                else:
                    one_by_one.append(s)  # re-run alone to confirm and attribute
        else:
            one_by_one = _no_graph_shortcut(runner, todo)
    for s in one_by_one:
        s.outcome = None
        try:
            outs, grads, report = runner.run([s], fullgraph=False)
        except SweepTimeout:
            raise
        except Exception as e:  # noqa: BLE001  (recorded as the outcome)
            if _dynamo_cannot_trace(runner, s):
                s.finish("skipped", f"torch.compile raises with backend='eager' too: {type(e).__name__}")
            else:
                s.finish("crash", f"{type(e).__name__}: {oneline(str(e))}")
            continue
        why = runner.check(s, outs[0], grads[0])
        fallbacks = _fallbacks(report)
        errors = [f for f in fallbacks if not _deliberate(f)]
        if why is not None:
            extra = f" (graphs ran eagerly: {fallbacks[0]})" if fallbacks else ""
            s.finish("mismatch", why + extra)
        elif errors and _pytorch_cannot_trace(runner, s, errors):
            s.finish("fallback", f"{errors[0]} (aot_eager fails too)")
        elif errors:
            s.finish("crash", f"ember error, caught by its fail-safe: {errors[0]}")
        elif fallbacks:
            s.finish("fallback", fallbacks[0])
        elif not report.graphs:
            s.finish("fallback", "Dynamo: no graph reached ember")
        else:
            s.finish("match")
    return samples
