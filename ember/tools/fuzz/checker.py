"""Checking programs: each against eager and a float64 reference, several compiled as one batch.

The comparison rule is in the package docstring (`ember.tools.fuzz`). A batch that fails is split
until the failing program is alone, so every outcome names its program.
"""

from __future__ import annotations

import contextlib
import math
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ember.frontend.backend import register
from ember.tools.fuzz.program import Program


@dataclass
class Outcome:
    program: Program
    status: str  # "ok" | "fallback" | "mismatch" | "crash" | "invalid"
    detail: str = ""


GRAD_TOL = 1e-3


def _tol(low: set[torch.dtype]) -> float:
    if torch.bfloat16 in low:
        return 2**-5
    if torch.float16 in low:
        return 2**-6
    return 1e-4


def compare(compiled: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor, tol: float) -> str | None:
    """None if `compiled` passes against eager and the float64 reference (the rule: `ember.tools.fuzz`'s docstring)."""
    if not isinstance(compiled, torch.Tensor):
        return f"compiled returned {type(compiled).__name__}"
    if compiled.shape != eager.shape:
        return f"shape {tuple(compiled.shape)} != eager {tuple(eager.shape)}"
    if compiled.dtype != eager.dtype:
        return f"dtype {compiled.dtype} != eager {eager.dtype}"
    if compiled.numel() == 0:
        return None
    if not eager.is_floating_point():
        if torch.equal(compiled, eager):
            return None
        bad = (compiled != eager).nonzero()[0].tolist()
        return f"{int((compiled != eager).sum())} elements differ, first at {bad}: {compiled[tuple(bad)]} vs {eager[tuple(bad)]}"
    c, e, r = (t.detach().double() for t in (compiled, eager, ref.to(eager.device)))

    def cls(t):
        return torch.where(torch.isnan(t), 0, torch.where(t == math.inf, 1, torch.where(t == -math.inf, 2, 3)))

    # The reference's class as the output's dtype holds it: a value past float32's range is inf there.
    cc, ce, cr = cls(c), cls(e), cls(ref.to(eager.device, eager.dtype).double())
    bad = (cc != ce) & (cc != cr)
    finite_r = torch.isfinite(r)
    scale = max(1.0, r[finite_r].abs().mean().item()) if finite_r.any() else 1.0
    fin = (cc == 3) & ~bad
    err = torch.where(finite_r, (c - r).abs(), (c - e).abs())
    bound = torch.where(finite_r, 2 * (e - r).abs() + tol * (r.abs() + scale), tol * (e.abs() + scale))
    bound = torch.where(torch.isfinite(bound), bound, torch.full_like(bound, math.inf))
    bad = bad | (fin & ~(err <= bound))
    if not bad.any():
        return None
    where = bad.nonzero()[0].tolist()
    at = tuple(where)
    return (
        f"{int(bad.sum())}/{bad.numel()} elements off, first at {where}: compiled {c[at].item():.6g}, "
        f"eager {e[at].item():.6g}, fp64 reference {r[at].item():.6g} (tol {tol:g}, scale {scale:.3g})"
    )


def _exec(source: str) -> dict:
    ns: dict = {"torch": torch}
    exec(compile(source, "<ember-fuzz>", "exec"), ns)  # noqa: S102 - our own generated program
    return ns


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _upcast(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.double() if x.is_floating_point() else x for x in inputs]


def cotangents(outputs: list) -> list:
    """Fixed pseudo-random cotangents for the outputs that require grad (the same for eager, ember, fp64)."""
    gen = torch.Generator().manual_seed(12345)
    diff = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    return [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in diff]


def grads(outputs: list, inputs: list, cots: list | None = None) -> list:
    """Gradients of the outputs that require grad, with `cots` (default: `cotangents(outputs)`), w.r.t.
    each input that requires grad; an input the outputs do not depend on gets zeros."""
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    diff = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if not leaves or not diff:
        return [torch.zeros_like(x) for x in leaves]
    cots = cotangents(outputs) if cots is None else cots
    found = torch.autograd.grad(diff, leaves, cots, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g.detach() for g, x in zip(found, leaves)]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _requiring_grad(inputs: list) -> list:
    return [x.requires_grad_(True) if x.is_floating_point() else x for x in inputs]


# Graphs, kernels and externs compiled (including batches re-run to isolate a failure).
STATS = {"graphs": 0, "kernels": 0, "externs": 0}


def check_batch(programs: list[Program], options: dict, device: str = "cpu") -> tuple[list[Outcome] | None, str]:
    """Compile the programs as one function: (per-program outcomes, "") or, if the batch needs
    splitting, (None, what went wrong)."""
    ns_src = []
    for k, p in enumerate(programs):
        ns_src += [p.source(f"program_{k}"), p.source(f"reference_{k}", reference=True), p.inputs_source(f"inputs_{k}")]
    ns = _exec("\n".join(ns_src))
    grad = any(p.grad for p in programs)  # run() batches gradient programs apart
    all_inputs = [ns[f"inputs_{k}"](device) for k in range(len(programs))]
    if grad:
        all_inputs = [_requiring_grad(xs) for xs in all_inputs]
    expected = [_eager_and_reference(ns, k, all_inputs[k], grad) for k in range(len(programs))]
    outcomes = [None if isinstance(e, tuple) else Outcome(p, "invalid", e) for p, e in zip(programs, expected)]
    live = [k for k in range(len(programs)) if outcomes[k] is None]
    got, trouble = _compiled_batch(ns, programs, live, all_inputs, options, grad)
    if trouble:
        if len(programs) > 1:
            return None, trouble
        status, detail = trouble.split(": ", 1)
        return [Outcome(programs[0], status, detail)], ""
    for j, k in enumerate(live):
        eager, ref = expected[k]
        problems = _differences(programs[k], all_inputs[k], _as_list(got[j]), eager, ref, grad)
        if problems and len(programs) > 1:
            return None, f"mismatch: program {programs[k].index}: " + "; ".join(problems)  # re-run it alone
        outcomes[k] = Outcome(programs[k], "mismatch" if problems else "ok", "; ".join(problems))
    return outcomes, ""


def _eager_and_reference(ns: dict, k: int, inputs: list, grad: bool) -> tuple[list, list] | str:
    """Program k's eager outputs and its float64 reference's (each followed by its gradients when
    `grad`), or why eager or the reference raised (the program is then invalid)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # e.g. var() with too few degrees of freedom
            # autograd.grad accumulates nothing: eager and ember may share the input leaves.
            ref_inputs = [x.detach().requires_grad_(x.requires_grad) for x in _upcast(inputs)]
            eager = _as_list(ns[f"program_{k}"](*inputs))
            with _default_dtype(torch.float64):  # int / 0.5 is float64 in the reference
                ref = _as_list(ns[f"reference_{k}"](*ref_inputs))
            if grad:
                eager = [o.detach() for o in eager] + grads(eager, inputs)
                ref = [o.detach() for o in ref] + grads(ref, ref_inputs)
            return eager, ref
    except Exception as e:  # noqa: BLE001 - counted, never silently dropped
        return f"eager or the reference raised {type(e).__name__}: {e}"


def _compiled_batch(
    ns: dict, programs: list[Program], live: list[int], all_inputs: list, options: dict, grad: bool
) -> tuple[list, str]:
    """The live programs compiled by ember as one function and run: each one's outputs (then its
    gradients when `grad`), and "" or the trouble ("crash: ..." or "fallback: ...")."""
    from ember.report import collecting

    counts = [len(programs[k].inputs) for k in live]

    def batch(*args):
        outs, at = [], 0
        for k, n in zip(live, counts):
            outs.append(ns[f"program_{k}"](*args[at : at + n]))
            at += n
        return tuple(outs)

    flat = [x for k in live for x in all_inputs[k]]
    dynamic = any(programs[k].dynamic for k in live)  # run() batches static and dynamic programs apart
    torch._dynamo.reset()
    got, crash = [], None
    with warnings.catch_warnings(record=True), collecting() as report:
        warnings.simplefilter("always")
        try:
            compiled = torch.compile(batch, backend=register(), dynamic=dynamic or None, options=options)
            got = compiled(*flat) if live else ()
            if grad and live:
                got = _with_batch_gradients(got, [all_inputs[k] for k in live], flat)
        except Exception as e:  # noqa: BLE001
            crash = f"{type(e).__name__}: {e}"[:2000] + "\n" + traceback.format_exc()[-3000:]
    fallbacks = [g.fallback for g in report.graphs if g.fallback]
    STATS["graphs"] += len(report.graphs)
    STATS["kernels"] += sum(len(g.kernels) for g in report.graphs)
    STATS["externs"] += sum(len(g.externs) for g in report.graphs)
    if crash:
        return got, f"crash: {crash}"
    return got, ("fallback: " + "; ".join(fallbacks)) if fallbacks else ""


def _with_batch_gradients(got: tuple, inputs: list[list], flat: list) -> list[list]:
    """Each program's outputs followed by its inputs' gradients, from one backward for the whole
    batch: the programs share no inputs, so each one's gradients are its own."""
    every = [o for out in got for o in _as_list(out)]
    cots = [c for out in got for c in cotangents(_as_list(out))]
    flat_grads = iter(grads(every, flat, cots))
    return [
        [o.detach() for o in _as_list(out)] + [next(flat_grads) for x in xs if x.requires_grad]
        for out, xs in zip(got, inputs)
    ]


def _differences(program: Program, inputs: list, outs: list, eager: list, ref: list, grad: bool) -> list[str]:
    """What differs between a program's compiled outputs (and gradients) and eager's, by the rule."""
    tol = _tol(program.low_precision)
    problems = []
    if len(outs) != len(eager):
        problems.append(f"{len(outs)} outputs, eager has {len(eager)}")
    names = [f"output {i} ({v.name})" for i, v in enumerate(program.outputs)]
    if grad:
        names += [f"grad of {v.name}" for (v, _), x in zip(program.inputs, inputs) if x.requires_grad]
    n_out = len(program.outputs)
    for i, (c, e, r) in enumerate(zip(outs, eager, ref)):
        # Gradients sum over broadcasts, often with cancellation: float32 gets 1e-3, as PyTorch's
        # dynamo benchmarks give training.
        msg = compare(c, e, r, tol if i < n_out else max(tol, GRAD_TOL))
        if msg:
            problems.append(f"{names[i]}: {msg}")
    return problems


def check(
    programs: list[Program],
    options: dict,
    device: str = "cpu",
    batch_checker: Callable[..., tuple[list[Outcome] | None, str]] = check_batch,
) -> list[Outcome]:
    """Check a batch with `batch_checker` (`check_batch`'s signature); split it where something
    went wrong, down to single programs.

    If every part passes on its own, the batch's trouble is blamed on all its programs (ember got
    them wrong only together), never dropped."""
    out, trouble = batch_checker(programs, options, device)
    if out is not None:
        return out
    mid = len(programs) // 2
    parts = check(programs[:mid], options, device, batch_checker) + check(
        programs[mid:], options, device, batch_checker
    )
    if any(o.status not in ("ok", "invalid") for o in parts):
        return parts
    status = trouble.split(":", 1)[0]
    together = f"only when compiled together with programs {[p.index for p in programs]}: {trouble}"
    return [Outcome(o.program, status, together) if o.status == "ok" else o for o in parts]
