"""`ember bench --profile`: where each compiler's time goes in a case, from torch.profiler.

Per case, eager and each compiler are compiled, run once and checked against the float32
reference as in a timing run (a mismatch is reported and not profiled). Then each one is timed as
the bench times it (`measure.Timer`: on a GPU the call's device and host parts too) and a few more
calls run under torch.profiler. The record gives, per call: the time, the host's and the device's
part (GPU), the kernels launched and their time, and the kernels with the most time (on the CPU,
the profiler sees ATen ops but not the C++ kernels Inductor generates: the table lists ops by their
own time, and Inductor's compiled region as one entry; ember's are compiled under the setting
`profile_ranges`, so each of its kernels is a range of its own, named as in its explain text). A wall time well above the device time is
host overhead; a large kernel one compiler has and another lacks is a missed fusion or a copy.

On a GPU one more call runs under the caching allocator's history recorder: the record keeps the
peak over what was allocated before the call and the largest blocks alive at it, each with the
Python lines that allocated it (for ember, lines of its host program, printed in the case's
explain file).

For ember, `explain/CASE.txt` holds each graph as `ember.explain` prints it, every kernel's
measured time, the fusion decisions, the host program, and the source of the kernels that took
the most time.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch

from ember import config
from ember.tools.bench import harness, measure
from ember.tools.bench.workloads import Case, missing_requirement

CALLS = 5  # calls profiled per compiler
SOURCES_SHOWN = 8  # kernels whose source the explain file prints, the slowest first


def profile_case(case: Case, s: harness.Settings, top: int = 25) -> tuple[dict, str]:
    """The case's profile record, and ember's explain text ("" without ember)."""
    w = case.workload
    record: dict = {"type": "profile", "case": case.key, "workload": w.name, "mode": case.mode}
    record["shape"], record["compilers"] = w.describe(w.sizes[s.scale]), {}
    record["kernels"] = "GPU kernels" if s.device.type == "cuda" else "CPU ops, by own time"
    reason = missing_requirement(w)
    if reason:
        record["skipped"] = reason
        return record, ""
    try:
        explain = _profile_compilers(case, s, top, record["compilers"])
    except Exception as e:  # noqa: BLE001 - reported in the case's record; the next case still runs
        record["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        record["trace"] = traceback.format_exc()[-2000:]
        explain = ""
    torch._dynamo.reset()
    return record, explain


def _profile_compilers(case: Case, s: harness.Settings, top: int, results: dict) -> str:
    """Eager's profile and each compiler's into `results`; returns ember's explain text."""
    from ember.report import collecting

    w, train = case.workload, case.mode == "train"
    torch.manual_seed(0)
    built = w.instance(s.scale, s.device, case.mode)
    inputs = measure.prepare_inputs(built.inputs, train)
    ref, ref_dtype = measure.reference(built, inputs, train, s.device, w.compute_dtype)
    eager = measure.Step(built.fn, train, built.autocast, s.device)
    check = harness.checker(ref, eager(*inputs), ref_dtype, w.compute_dtype, train)
    input_sets = measure.copies_of(inputs, measure.rotations(inputs, measure.cache_bytes(s.device)[0]))
    results["eager"] = {"status": "ok", **profile_step(eager, input_sets, s, top)}
    results["eager"].pop("kernel_us")
    torch._dynamo.reset()
    explain = ""
    for compiler in s.compilers:
        s.progress(f"{case.key}: {compiler}")
        # On the CPU ember's kernels are no profiler events of their own: ranges named after them are.
        ranges = compiler.startswith("ember") and s.device.type == "cpu"
        with config.override(profile_ranges=True) if ranges else contextlib.nullcontext():
            with collecting() as report:
                result, step = harness.run_compiler(case, compiler, built, inputs, check, s)
            if step is not None:
                result.update(profile_step(step, input_sets, s, top))
        if compiler == "ember":
            explain = explain_text(report, result.get("kernel_us", {}))
        result.pop("kernel_us", None)
        results[compiler] = result
    return explain


def profile_step(step, input_sets: list[tuple], s: harness.Settings, top: int) -> dict:
    """One step's time per call (and its host and device parts on a GPU), then `CALLS` calls under
    torch.profiler: the kernels' time per call and the `top` kernels; on a GPU also the host's ops
    by their own time, and the memory at the peak."""
    s.timer.last = None
    result: dict = {"ms": s.timer.time_step(step, input_sets)}
    result.update(s.timer.last or {})
    from torch.profiler import ProfilerActivity, profile, schedule

    measure.quiet_kineto()
    cuda = s.device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    # The first call under the profiler pays for its start (on the CPU, milliseconds in the first
    # ops it records): it runs as a warm-up step, not recorded. The device is waited for after it
    # and after the last call only, so the calls in between queue as they do in a loop.
    plan = schedule(wait=0, warmup=1, active=CALLS, repeat=1)
    with profile(activities=activities, schedule=plan, acc_events=True) as prof:
        for i in range(CALLS + 1):
            step(*input_sets[i % len(input_sets)])
            if i in (0, CALLS):
                measure.sync(s.device)
            prof.step()
    events = prof.events()
    result.update(kernel_table(events, cuda, CALLS, top))
    if cuda:
        # The host's side under the profiler (which slows it): ATen ops, compiled regions, launches.
        host = kernel_table(events, False, CALLS, top)
        result["host_ops_us_per_call"], result["host_top"] = host["kernels_us_per_call"], host["top"]
        result["memory"] = alive_at_peak(step, input_sets[0])
    return result


def kernel_table(events, cuda: bool, calls: int, top: int) -> dict:
    """Per call: the kernels' total time, how many ran, and the `top` by time (name, runs, µs).
    `kernel_us` keeps every kernel's time per call, by name, for the explain file.

    GPU: the device's kernel and copy events. CPU: the profiler's ops, each by its own time (its
    children's taken out), so nested ops are not counted twice."""
    seen: dict[str, list] = {}
    for e in events:
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time
        elif not cuda and e.device_type == torch.autograd.DeviceType.CPU:
            us = e.self_cpu_time_total
        else:
            continue
        if e.name.startswith("ProfilerStep"):  # the profiler's own step markers
            continue
        entry = seen.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    ranked = sorted(seen.items(), key=lambda kv: -kv[1][1])
    return {
        "kernels_us_per_call": sum(us for _, us in seen.values()) / calls,
        "kernels_per_call": sum(n for n, _ in seen.values()) / calls,
        "top": [
            {"name": n[:160], "runs_per_call": c / calls, "us_per_call": us / calls} for n, (c, us) in ranked[:top]
        ],
        "kernel_us": {n: us / calls for n, (_, us) in seen.items()},
    }


def alive_at_peak(step, inputs: tuple, blocks: int = 20) -> dict:
    """One call under the CUDA caching allocator's history recorder: the peak of what the call
    allocated (MB, over what was allocated before it, as the bench's peak column), how many blocks
    were alive then, and the largest, each with the frames that allocated it."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    try:
        out = step(*inputs)
        torch.cuda.synchronize()
        del out
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for e in snapshot["device_traces"][device]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    largest = sorted(at_peak, key=lambda e: -e["size"])[:blocks]
    return {
        "peak_mb": peak / 1e6,
        "blocks_alive": len(at_peak),
        "largest": [{"mb": round(b["size"] / 1e6, 3), "frames": _own_frames(b)} for b in largest],
    }


_HARNESS = os.path.dirname(os.path.abspath(__file__))  # the bench's own frames say nothing of the program
_TOOLS = os.path.dirname(_HARNESS)
_EMBER = os.path.dirname(_TOOLS)


def _own_frames(event: dict) -> list[str]:
    """The innermost frames of an allocation outside torch, ember's runtime and the bench: ember's
    host program, Inductor's generated code and the model's code, each as its file's last two path
    parts."""
    keep = []
    for f in event.get("frames", []):
        name = f.get("filename", "")
        compiler = name.startswith(_EMBER) and not name.startswith(_TOOLS)
        if f"{os.sep}torch{os.sep}" in name or name.startswith((_HARNESS, "<frozen")) or compiler:
            continue
        short = os.sep.join(name.split(os.sep)[-2:])
        keep.append(f"{short}:{f.get('line')} {f.get('name')}")
    return keep[:3]


def explain_text(report, kernel_us: dict[str, float]) -> str:
    """ember's graphs for one case: each as `ember.explain` prints it, its kernels' measured time
    per call (GPU; "-" where the profiler saw no kernel of that name), its fusion decisions and host
    program, and the source of its slowest kernels."""
    parts = []
    for g in report.graphs:
        parts.append(str(g))
        if g.fallback:
            continue
        parts += [f"  measured {k.name}: {_us(kernel_us.get(k.name))}" for k in g.kernels]
        parts.append("  fusion decisions:")
        parts += [f"    {d}" for d in g.fusion]
        parts.append(f"\n--- {g.kind} host program ---\n{g.host_source}")
        slowest = sorted(g.kernels, key=lambda k: -kernel_us.get(k.name, 0.0))[:SOURCES_SHOWN]
        parts += [f"\n--- {k.name} ({_us(kernel_us.get(k.name))}) ---\n{k.source}" for k in slowest]
    return "\n".join(parts) + "\n" if parts else "ember compiled no graphs\n"


def _us(us: float | None) -> str:
    return "-" if us is None else f"{us:.1f} us per call"


def markdown(records: list[dict], header: str) -> str:
    """profile.md: per case, a row per compiler, then each one's kernels with the most time."""
    lines = [header]
    for r in (r for r in records if r.get("type") == "profile"):
        lines += ["", f"## {r['case']} ({r['shape']})", ""]
        if r.get("skipped") or r.get("error"):
            lines.append(r.get("skipped") or f"error: {r['error']}")
            continue
        what = r.get("kernels", "GPU kernels")
        lines += [
            f"| compiler | ms per call | host ms | device ms | {what} per call | their ms per call | peak MB |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [_row(name, c) for name, c in r["compilers"].items()]
        for name, c in r["compilers"].items():
            lines += _top(f"{name}, the {what} with the most time", c.get("top"))
            lines += _top(f"{name}, the host's ops with the most own time, under the profiler", c.get("host_top"))
            lines += _alive_at_peak(name, c.get("memory"))
    return "\n".join(lines) + "\n"


def _top(title: str, entries: list[dict] | None) -> list[str]:
    if not entries:
        return []
    lines = ["", f"{title} (µs per call, runs per call):", "", "```"]
    lines += [f"{k['us_per_call']:10.1f}  {k['runs_per_call']:5.1f}  {k['name']}" for k in entries]
    return lines + ["```"]


def _alive_at_peak(name: str, memory: dict | None) -> list[str]:
    if not memory:
        return []
    lines = ["", f"{name}, the largest of {memory['blocks_alive']} blocks alive at the peak (MB, allocated at):", ""]
    lines += ["```"] + [f"{b['mb']:10.3f}  {' < '.join(b['frames']) or '(no Python frame)'}" for b in memory["largest"]]
    return lines + ["```"]


def _row(name: str, c: dict) -> str:
    if "ms" not in c:
        return f"| {name} | {c.get('status')}: {c.get('note', '')[:120]} | | | | | |"

    def cell(v, fmt="{:.3f}"):
        return "" if v is None else fmt.format(v)

    peak = (c.get("memory") or {}).get("peak_mb")
    return (
        f"| {name} | {cell(c['ms'])} | {cell(c.get('host_ms'))} | {cell(c.get('device_ms'))} "
        f"| {cell(c['kernels_per_call'], '{:.0f}')} | {cell(c['kernels_us_per_call'] / 1000)} "
        f"| {cell(peak, '{:.1f}')} |"
    )
