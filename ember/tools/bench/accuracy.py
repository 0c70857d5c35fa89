"""Model accuracy the way PyTorch's dynamo benchmarks check it: against a float64 reference.

    ember bench --accuracy                                          # every workload, both modes
    ember bench --accuracy --workloads model --no-inductor --out DIR

For each case (a workload in inference, or one training step: outputs and the gradients of every
floating input and parameter, with fixed random cotangents):

* eager runs in the workload's own dtype (bf16 weights, or autocast) and so does each compiler;
* the reference runs the same step in float64: a copy of the module with the same (already
  rounded) weights in float64, floating inputs in float64, no autocast;
* for every tensor (each output, each gradient) a compiler passes if it is allclose to eager
  (rtol = atol = tol), or else if
      RMSE(compiled, fp64) <= m * RMSE(eager, fp64) + tol / 10
  with m = 3 for bfloat16/float16 tensors and 2 otherwise (`torch._dynamo.utils.same` with
  `fp64_ref`, as `benchmarks/dynamo/common.py` calls it). tol is 1e-4 for float32 inference,
  1e-3 for float32 training and 1e-2 for low-precision workloads (bf16 or autocast), the
  tolerances those benchmarks use.

A case passes when every tensor does. One JSON record per case (per-tensor errors included),
and a markdown table (`accuracy.md`).
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback

import torch
import torch._dynamo
from torch import nn

from ember.tools.bench import measure
from ember.tools.bench.compilers import compile_fn
from ember.tools.bench.float64_rule import TensorCheck, check_tensor, tolerance_for
from ember.tools.bench.float64_rule import ratio as _ratio
from ember.tools.bench.workloads import Case, missing_requirement


def tolerance(case: Case) -> float:
    return tolerance_for(case.workload.dtype != "f32", case.mode == "train")


def step(fn, module, inputs: tuple, train: bool, autocast, device, cotangents=None):
    """(names, tensors, cotangents) of one step: the outputs, then in training the gradients of every
    floating input and parameter of `module` (the uncompiled module: a compiled one shares them)."""
    ctx = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    if not train:
        with torch.no_grad(), ctx:
            outs = measure.tensors(fn(*inputs))
        return [f"output {k}" for k in range(len(outs))], [o.detach() for o in outs], None
    with ctx:
        outs = measure.tensors(fn(*inputs))
    diff = [k for k, o in enumerate(outs) if o.requires_grad]
    leaves = [(f"grad input {k}", x) for k, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    if isinstance(module, nn.Module):
        leaves += [(f"grad {n}", p) for n, p in module.named_parameters() if p.requires_grad]
    if cotangents is None:
        gen = torch.Generator(device=device).manual_seed(1)
        cotangents = [torch.randn(outs[k].shape, generator=gen, device=device, dtype=outs[k].dtype) for k in diff]
    cots = [c.to(outs[k].dtype) for k, c in zip(diff, cotangents)]
    grads = torch.autograd.grad([outs[k] for k in diff], [x for _, x in leaves], cots, allow_unused=True)
    names = [f"output {k}" for k in range(len(outs))] + [n for (n, _), g in zip(leaves, grads) if g is not None]
    tensors = [o.detach() for o in outs] + [g for g in grads if g is not None]
    return names, tensors, cotangents


def run_case(case: Case, compilers: list[str], scale: str, device: torch.device) -> dict:
    w = case.workload
    record: dict = {"type": "accuracy", "case": case.key, "workload": w.name, "mode": case.mode, "dtype": w.dtype}
    record["shape"] = w.describe(w.sizes[scale])
    reason = missing_requirement(w)
    if reason:
        record["skipped"] = reason
        return record
    train = case.mode == "train"
    tol = tolerance(case)
    record["tol"] = tol
    try:
        torch.manual_seed(0)
        built = w.instance(scale, device, case.mode)
        inputs = measure.prepare_inputs(built.inputs, train)
        names, eager, cotangents = step(built.fn, built.fn, inputs, train, built.autocast, device)
        module64, inputs64 = measure.upcast_copy(built, inputs, torch.float64)
        cot64 = [c.double() for c in cotangents] if cotangents is not None else None
        ref_names, ref, _ = step(module64, module64, inputs64, train, None, device, cot64)
        if ref_names != names:
            raise RuntimeError(f"the float64 step made {ref_names}, eager {names}")
        del module64, inputs64
    except Exception as e:  # noqa: BLE001 - reported in the case's row
        record["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        record["trace"] = traceback.format_exc()[-2000:]
        return record
    record["compilers"] = {}
    for compiler in compilers:
        torch._dynamo.reset()
        fn = compile_fn(built.fn, compiler)
        result: dict = {}
        try:
            from ember.report import collecting

            t0 = time.perf_counter()
            with collecting() as report:
                got_names, got, _ = step(fn, built.fn, inputs, train, built.autocast, device, cotangents)
            result["seconds"] = time.perf_counter() - t0
            if compiler.startswith("ember"):
                result["fallbacks"] = [f"{g.kind}: {g.fallback}" for g in report.graphs if g.fallback]
        except Exception as e:  # noqa: BLE001 - a crash is a result
            result.update(status="error", note=f"{type(e).__name__}: {str(e)[:300]}")
            record["compilers"][compiler] = result
            continue
        if got_names != names:
            checks = [TensorCheck("outputs", False, f"made {got_names}, eager {names}", *(math.nan,) * 3)]
        else:
            checks = [check_tensor(n, g, e, r, tol) for n, g, e, r in zip(names, got, eager, ref)]
        failed = [c for c in checks if not c.passed]
        worst = max(checks, key=lambda c: (not c.passed, _ratio(c)))
        result.update(
            status="fail" if failed else "pass",
            tensors=len(checks),
            failed=[c.record() for c in failed],
            worst=worst.record(),
            note="; ".join(f"{c.name}: {c.how}" for c in failed[:3]),
        )
        record["compilers"][compiler] = result
        del got
    torch._dynamo.reset()
    return record


def markdown(records: list[dict], header: str = "") -> str:
    lines = [header] if header else []
    compilers = sorted({c for r in records for c in r.get("compilers", {})})
    lines.append(
        "| case | dtype | shape | compiler | result | tensors | worst tensor | eager RMSE | compiled RMSE | bound |"
    )
    lines.append("|---|---|---|---|---|---:|---|---:|---:|---:|")
    for r in records:
        if r.get("type") != "accuracy":
            continue
        if r.get("skipped") or r.get("error"):
            lines.append(
                f"| {r['case']} | {r['dtype']} | {r.get('shape', '')} | | {r.get('skipped') or r['error']} |||||"
            )
            continue
        for comp in compilers:
            c = r["compilers"].get(comp)
            if c is None:
                continue
            if c["status"] == "error":
                lines.append(f"| {r['case']} | {r['dtype']} | {r['shape']} | {comp} | error: {c['note']} |||||")
                continue
            w = c["worst"]
            result = c["status"].upper() if c["status"] == "fail" else "pass"
            if c.get("fallbacks"):
                result += f" (fell back: {len(c['fallbacks'])} graphs)"
            lines.append(
                f"| {r['case']} | {r['dtype']} | {r['shape']} | {comp} | {result} | {c['tensors']} | {w['name']} "
                f"({w['how']}) | {w['eager_rmse']:.3g} | {w['compiled_rmse']:.3g} | {w['bound']:.3g} |"
            )
    return "\n".join(lines) + "\n"


def run(
    cases: list[Case], compilers: list[str], scale: str, device: torch.device, emit=print, deadline: float | None = None
) -> list[dict]:
    """Each case checked in turn; once `deadline` (a time.time()) has passed, the cases left are recorded as
    not run, with the reason."""
    records = []
    for case in cases:
        if deadline is not None and time.time() > deadline:
            w = case.workload
            rec = {"type": "accuracy", "case": case.key, "workload": w.name, "mode": case.mode, "dtype": w.dtype}
            rec["skipped"] = "not run: the run's time budget was spent"
        else:
            rec = run_case(case, compilers, scale, device)
        records.append(rec)
        emit(rec)
    return records


def one_line(r: dict) -> str:
    if r.get("skipped") or r.get("error"):
        return f"{r['case']}: {r.get('skipped') or 'error: ' + r['error']}"
    parts = []
    for comp, c in r["compilers"].items():
        if c["status"] == "error":
            parts.append(f"{comp} error ({c['note']})")
        else:
            w = c["worst"]
            parts.append(
                f"{comp} {c['status']} ({c['tensors']} tensors; worst {w['name']}: {w['how']}, "
                f"RMSE {w['compiled_rmse']:.3g} vs eager {w['eager_rmse']:.3g})"
            )
    return f"{r['case']}: " + ", ".join(parts)
