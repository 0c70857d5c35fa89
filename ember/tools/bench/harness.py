"""The benchmark run: for each case, eager and each compiler in one process, then compile times.

Per case: build the workload (seeded), compute a reference (measure.reference: float32 for a
low-precision workload, float64 for a float32 one) and eager's output, count the limit (bytes,
FLOPs); then for each compiler: compile and run once (its first call), check each output against the
reference (`checker`: by the float64 rule against float64, within twice eager's own error plus slack
against float32; a mismatch is recorded and not timed). Then time eager and every
compiler that passed in `rounds` rounds that take turns (the order rotates each round), and report
each one's median over the rounds: the device's speed drifts over seconds (clocks, other tenants
of the host), and timing A then B once puts that drift into A/B. Last, each one's peak memory. ember's reports say how many kernels and externs it made and which graphs fell back
to eager; a case where ember fell back is still timed, and says so. One JSON record per case.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._dynamo

from ember import config
from ember.tools import timing_noise
from ember.tools.bench import compile_time, float64_rule, host_cost, measure, memory
from ember.tools.bench.compilers import PEERS, compile_fn
from ember.tools.bench.workloads import Case, missing_requirement


@dataclass
class Settings:
    device: torch.device
    scale: str
    compilers: list[str]  # e.g. ["inductor", "ember"], "inductor:max-autotune", "ember:MODE"
    timer: measure.Timer
    compile_time: list[str] | None = None  # case keys to measure compile time for, in this order
    compile_timeout_s: float = 600.0
    compile_imported: bool = False  # compile time: also a fresh process that imports the cold run's cache file
    deadline: float | None = None  # time.time() after which no new measurement starts
    emit: Callable[[dict], None] = print
    progress: Callable[[str], None] = lambda line: None
    notes: list[str] = field(default_factory=list)
    rounds: int = 1  # timing rounds per case, taking turns among eager and the compilers

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline


def environment(settings: Settings) -> dict:
    import triton

    dev = settings.device
    return {
        "type": "run",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU: {_cpu_name()}",
        "cpus": _cpu_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "scale": settings.scale,
        "compilers": settings.compilers,
        "cache": measure.cache_bytes(dev),
        "settings": config.changed(),  # ember's settings that are not their defaults (EMBER_* variables)
        # other processes on a small CPU machine change CPU times: the load says whether there were any
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _free(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _ember_summary(report) -> dict:
    graphs = report.graphs
    return {
        "graphs": len(graphs),
        "kernels": sum(len(g.kernels) for g in graphs),
        "externs": sum(len(g.externs) for g in graphs),
        "fallbacks": [f"{g.kind}: {g.fallback}" for g in graphs if g.fallback],
        "pipeline_s": sum(g.compile_seconds for g in graphs),
    }


def checker(ref: list, eager_out: list, ref_dtype, dtype: torch.dtype, train: bool) -> Callable[[list], tuple]:
    """How a compiled step's outputs are checked, as `check(outputs) -> (err, tol, failure or None)`.
    Against a float64 reference (a float32 workload): each output by the float64 rule of accuracy.py,
    err and tol being the RMSE and bound of the first output that fails, else of the one nearest its
    bound. Against a float32 one (a low-precision workload): each output's max relative error within
    twice eager's on it plus the slack of `dtype`, the workload's (measure.tolerance), err and tol those
    of the output furthest past its own."""
    if ref_dtype != torch.float64:
        tols = measure.tolerances(dtype, measure.errors(eager_out, ref))

        def by_rel_err(out: list) -> tuple:
            err, tol = measure.worst(out, ref, tols)
            return err, tol, None if err <= tol else f"max rel err {err:.2e} > tol {tol:.2e}"

        return by_rel_err
    eager = [e.detach().clone() for e in eager_out]
    rule_tol = float64_rule.tolerance_for(False, train)

    def by_float64_rule(out: list) -> tuple:
        if len(out) != len(ref):
            return math.inf, 0.0, f"{len(out)} outputs, the reference has {len(ref)}"
        checks = [float64_rule.check_tensor(f"output {k}", *t, rule_tol) for k, t in enumerate(zip(out, eager, ref))]
        failed = next((c for c in checks if not c.passed), None)
        shown = failed or max(checks, key=float64_rule.ratio, default=None)
        if shown is None:
            return 0.0, 0.0, None
        return shown.compiled_rmse, shown.bound, None if failed is None else f"{failed.name}: {failed.how}"

    return by_float64_rule


def run_compiler(case: Case, compiler: str, built, inputs, check, s: Settings) -> tuple[dict, object]:
    """Compile, run once and check its outputs (`check`, from `checker`); returns the result and the
    step to time (None: not timed).

    Compilers share Dynamo's cache here (no reset between them): its entries are guarded by
    backend, so each compiled step keeps its own code while the rounds alternate."""
    from ember.report import collecting

    train = case.mode == "train"
    step = measure.Step(compile_fn(built.fn, compiler), train, built.autocast, s.device)
    result: dict = {}
    if built.reset is not None:
        built.reset()
    try:
        with collecting() as report:
            t0 = time.perf_counter()
            out = step(*inputs)
            measure.sync(s.device)
            result["first_call_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a compiler that crashes is a result, not the end of the run
        result.update(status="error", note=f"{type(e).__name__}: {str(e)[:300]}", trace=traceback.format_exc()[-2000:])
        return result, None
    if compiler.startswith("ember"):
        result.update(_ember_summary(report))
    err, tol, failure = check(out)
    del out
    result["err"], result["tol"] = err, tol
    if failure is not None:
        result.update(status="mismatch", note=failure)
        return result, None
    result["status"] = "fell back" if result.get("fallbacks") else "ok"
    return result, step


def _time_in_rounds(steps: dict, input_sets, rounds: int, timer: measure.Timer) -> dict[str, list]:
    """Each step's time in every round, and on a GPU its device and host parts (`Timer.last`);
    round r starts with the r-th step (the order rotates)."""
    names = list(steps)
    times: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            timer.last = None
            ms = timer.time_step(steps[name], input_sets)
            times[name].append((ms, timer.last))
    return times


def run_case(case: Case, ceilings: dict, s: Settings) -> dict:
    w = case.workload
    size = w.sizes[s.scale]
    record = {
        "type": "case",
        "case": case.key,
        "workload": w.name,
        "mode": case.mode,
        "group": w.group,
        "dtype": w.dtype,
        "shape": w.describe(size),
        "compilers": {},
    }
    reason = missing_requirement(w)
    if reason:
        record["skipped"] = reason
        return record
    if s.out_of_time():
        record["skipped"] = "not run: the run's time budget was spent"
        return record
    if w.runner is not None:  # a workload that measures itself (a decoding loop)
        return w.runner(case, s, record, ceilings)
    train = case.mode == "train"
    try:
        torch.manual_seed(0)
        built = w.instance(s.scale, s.device, case.mode)
        inputs = measure.prepare_inputs(built.inputs, train)
        ref_dtype = None
        if built.reference is not None:
            ref = built.reference()
        else:
            ref, ref_dtype = measure.reference(built, inputs, train, s.device, w.compute_dtype)
            record["reference_dtype"] = str(ref_dtype).removeprefix("torch.")
        eager = measure.Step(built.fn, train, built.autocast, s.device)
        if built.reset is not None:
            built.reset()
        eager_out = eager(*inputs)
        flops = measure.count_flops(eager, inputs)
        least = built.bytes or measure.min_bytes(built.fn, inputs, eager_out, eager.cotangents)
        limit = {"bytes": least, "flops": flops}
        check = checker(ref, eager_out, ref_dtype, w.compute_dtype, train)
        record["eager_err"] = measure.max_err(eager_out, ref)
        del eager_out
        limit["floor_ms"] = measure.floor_ms(limit, ceilings, w.compute_dtype)
        record["limit"] = limit
        n = measure.rotations(inputs, measure.cache_bytes(s.device)[0])
        record["rotations"] = n
        input_sets = measure.copies_of(inputs, n)
        record["compilers"]["eager"] = {"status": "ok"}
    except Exception as e:  # noqa: BLE001 - reported in the case's row
        record["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        record["trace"] = traceback.format_exc()[-2000:]
        _free(s.device)
        return record
    torch._dynamo.reset()
    steps = {"eager": eager}
    for compiler in s.compilers:
        if train and compiler in PEERS:
            record["compilers"][compiler] = {"status": "skipped", "note": "runs inference only"}
            continue
        s.progress(f"{case.key}: {compiler}")
        record["compilers"][compiler], step = run_compiler(case, compiler, built, inputs, check, s)
        if step is not None:
            steps[compiler] = step
        _free(s.device)
    s.progress(f"{case.key}: timing {len(steps)} in {s.rounds} round(s)")
    _time_steps(steps, inputs, input_sets, record, s)
    if w.host_cost:
        _graph_host_costs(case, built, inputs, steps, record, s)
    if w.others is not None:  # other frameworks' programs of the same step, each in its own process
        record["compilers"].update(w.others(case, s))
    del built, inputs, input_sets, ref, steps, eager
    torch._dynamo.reset()
    _free(s.device)
    return record


def _time_steps(steps: dict, inputs: tuple, input_sets: list, record: dict, s: Settings) -> None:
    """Each step's median time over rounds that take turns, its device and host parts (GPU), its
    peak memory and its GPU-busy time, into its compiler's result."""
    for name, timed in _time_in_rounds(steps, input_sets, s.rounds, s.timer).items():
        result = record["compilers"][name]
        ms = [t for t, _ in timed]
        result["ms"] = statistics.median(ms)
        if len(ms) > 1:
            result["ms_rounds"] = ms
        parts = [p for _, p in timed if p]
        if parts:  # GPU: the call's time is the larger of these two
            result["device_ms"] = statistics.median(p["device_ms"] for p in parts)
            result["host_ms"] = statistics.median(p["host_ms"] for p in parts)
        pools = memory.graph_pools(name, s.device)
        result["peak_mb"] = memory.peak_memory_mb(steps[name], inputs, s.device, pools)
        result["busy_ms"] = measure.busy_ms(steps[name], input_sets, s.device)


def _graph_host_costs(case: Case, built, inputs, steps: dict, record: dict, s: Settings) -> None:
    """Each compiler's host µs per call of its compiled graph called directly (host_cost.py)."""
    for name in steps:
        try:
            call = host_cost.graph_call(built.fn, name, inputs, case.mode == "train")
            if call is not None:
                record["compilers"][name]["graph_host_us"] = host_cost.host_us(call, s.timer)
        except Exception as e:  # noqa: BLE001 - the column stays empty, with the reason
            record["compilers"][name]["graph_host_note"] = f"{type(e).__name__}: {str(e)[:200]}"
        _free(s.device)


def run_compile_times(case: Case, s: Settings) -> dict:
    record = {"type": "compile", "case": case.key, "workload": case.workload.name, "mode": case.mode}
    reason = missing_requirement(case.workload)
    if reason:
        record["skipped"] = reason
    elif s.out_of_time():
        record["skipped"] = "not measured: the run's time budget was spent"
    else:
        compilers = [c for c in s.compilers if not (case.mode == "train" and c in PEERS)]
        record["compilers"] = compile_time.measure(
            case.workload.name, case.mode, compilers, s.scale, str(s.device), s.compile_timeout_s, s.compile_imported
        )
    return record


def run(cases: list[Case], s: Settings, timing: bool = True) -> list[dict]:
    """Run every case (timing, then compile times); emit and return the records."""
    records = [environment(s)]
    s.emit(records[0])
    load = records[0]["load_average"]
    busy = timing_noise.load_warning(load[0] if load else None, records[0]["cpus"])
    if busy:
        print(f"warning: {busy}", file=sys.stderr, flush=True)
    dtypes = sorted({c.workload.compute_dtype for c in cases}, key=str) or [torch.float32]
    s.progress("measuring the device's ceilings")
    ceilings = {"type": "ceilings", **measure.measure_ceilings(s.device, dtypes, s.scale)}
    records.append(ceilings)
    s.emit(ceilings)
    if timing:
        for case in cases:
            s.progress(f"{case.key}: eager")
            rec = run_case(case, ceilings, s)
            records.append(rec)
            s.emit(rec)
    by_key = {c.key: c for c in cases}
    for key in s.compile_time or []:
        s.progress(f"{key}: compile time in fresh processes")
        rec = run_compile_times(by_key[key], s)
        records.append(rec)
        s.emit(rec)
    return records
