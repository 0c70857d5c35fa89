"""`ember profile WORKLOAD`: where a model's step spends its time, from a torch.profiler trace, and a verdict.

The step is the bench's (`measure.Step`: the forward, and the backward by autograd.grad when training) of
one of its workloads, compiled by ember (or `--compiler eager|inductor`), warmed up, then `--calls` steps
profiled. Each step's wall time is split into:

- GEMM/attention: products, convolutions and attention (cuBLAS/cuDNN/flash kernels, ember's FlexAttention
  ones; on the CPU the ATen ops mm, addmm, bmm, convolution, scaled_dot_product_attention and their kin);
- fused kernels: every other kernel (ember's, Inductor's, eager's elementwise ones); on the CPU, where
  the profiler does not see generated C++ kernels, the rest of the time inside compiled regions and ATen ops;
- memory copies: memcpy/memset (GPU), copy_/clone/contiguous (CPU);
- communication: NCCL or gloo collectives;
- launch overhead (host gaps): on the GPU, time the device waited with no kernel while the host was not
  in a synchronizing call (it was launching, or running Python); on the CPU, the step's time outside any
  ATen op or compiled region: Python, guards and dispatch;
- idle: on the GPU, time with no kernel while the host waited in a synchronization.

The top kernels come from the bench's `profile.kernel_table`. The verdict is "overhead-bound" when host
gaps take more than a quarter of the step (or the device is busy less than 70% of it), else "healthy",
with the numbers that decided it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field

import torch

from ember.tools.bench.overlap import intersection, merged

CATEGORIES = ("GEMM/attention", "fused kernels", "memory copies", "communication", "launch overhead", "idle")

_GEMM_GPU = re.compile(
    r"gemm|cutlass|xmma|cublas|matmul|nvjet|flash|fmha|attention|sdpa|conv|cudnn|wgrad|dgrad|^flex_", re.IGNORECASE
)
_GEMM_CPU = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::convolution",
    "aten::_convolution",
    "aten::mkldnn_convolution",
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}
_COPY_CPU = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::to"}
_COMM = re.compile(r"nccl|gloo|c10d::|all_reduce|allreduce|all_gather|reduce_scatter|broadcast", re.IGNORECASE)
_SYNC = re.compile(r"Synchronize|cudaMemcpy(?!Async)|cudaStreamWait|cudaEventSynchronize", re.IGNORECASE)
_COMPILED = re.compile(r"Torch-Compiled Region|CompiledFunction|## Call CompiledFxGraph|ember", re.IGNORECASE)


@dataclass
class Profile:
    workload: str
    mode: str
    compiler: str
    device: str
    step_ms: float  # per step, wall time as the profiler saw it
    split_ms: dict[str, float] = field(default_factory=dict)  # per step, by category
    kernels_per_step: float = 0.0
    top: list[dict] = field(default_factory=list)
    verdict: str = ""

    def table(self) -> str:
        lines = [f"{self.workload} {self.mode}, {self.compiler} on {self.device}: {self.step_ms:.3f} ms per step"]
        lines += [
            f"  {name:<18}{ms:9.3f} ms {100 * ms / self.step_ms if self.step_ms else 0:5.1f}%"
            for name, ms in self.split_ms.items()
        ]
        lines.append(f"  {self.kernels_per_step:.0f} kernels (GPU) or ops (CPU) per step; the top ones (µs per step):")
        lines += [f"  {k['us_per_call']:10.1f}  {k['runs_per_call']:5.1f}  {k['name'][:90]}" for k in self.top]
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _gaps(busy: list[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    gaps, at = [], window[0]
    for s, e in busy:
        if s > at:
            gaps.append((at, min(s, window[1])))
        at = max(at, e)
    if at < window[1]:
        gaps.append((at, window[1]))
    return [(s, e) for s, e in gaps if e > s]


def split_gpu(events, windows: list[tuple[float, float]]) -> tuple[dict[str, float], float]:
    """Microseconds per category over the profiled steps (`windows`, the host's spans of them), and the
    device's busy time."""
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    parts: dict[str, list] = {c: [] for c in CATEGORIES[:4]}
    for k in kernels:
        span = (k.time_range.start, k.time_range.end)
        if _COMM.search(k.name):
            parts["communication"].append(span)
        elif k.name.startswith(("Memcpy", "Memset")):
            parts["memory copies"].append(span)
        elif _GEMM_GPU.search(k.name):
            parts["GEMM/attention"].append(span)
        else:
            parts["fused kernels"].append(span)
    split = {c: _length(merged(spans)) for c, spans in parts.items()}
    busy = merged([s for spans in parts.values() for s in spans])
    gaps = [g for w in windows for g in _gaps(busy, w)]
    syncs = merged(
        [(e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CPU" and _SYNC.search(e.name)]
    )
    idle = intersection(gaps, syncs)
    split["launch overhead"] = _length(gaps) - idle
    split["idle"] = idle
    return split, _length(busy)


def split_cpu(events, windows: list[tuple[float, float]]) -> dict[str, float]:
    """CPU: the main thread's top-level spans, split; what lies outside any is host overhead."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.name.startswith("Profiler")]
    spans: dict[str, list] = {c: [] for c in CATEGORIES[:4]}
    regions = []
    for e in cpu:
        span = (e.time_range.start, e.time_range.end)
        if _COMM.search(e.name):
            spans["communication"].append(span)
        elif e.name in _GEMM_CPU:
            spans["GEMM/attention"].append(span)
        elif e.name in _COPY_CPU:
            spans["memory copies"].append(span)
        elif e.name.startswith("aten::") or _COMPILED.search(e.name):
            regions.append(span)
    gemm, copies, comm = (merged(spans[c]) for c in ("GEMM/attention", "memory copies", "communication"))
    taken = merged(gemm + copies + comm)
    work = merged(regions + taken)
    split = {
        "GEMM/attention": _length(gemm),
        "fused kernels": _length(work) - _length(taken),
        "memory copies": _length(copies) - intersection(copies, gemm),
        "communication": _length(comm),
        "launch overhead": max(0.0, _length(windows) - intersection(work, windows)),
        "idle": 0.0,
    }
    return split


def verdict(split_ms: dict[str, float], step_ms: float, busy_ms: float | None, kernels: float) -> str:
    if step_ms <= 0:
        return "no time measured"
    host = split_ms["launch overhead"] / step_ms
    busy = busy_ms / step_ms if busy_ms is not None else 1 - host
    if host > 0.25 or busy < 0.7:
        per_kernel = 1000 * step_ms / kernels if kernels else 0.0
        return (
            f"overhead-bound: host gaps take {100 * host:.0f}% of the step and the "
            f"{'device' if busy_ms is not None else 'CPU'} works {100 * busy:.0f}% of it "
            f"({kernels:.0f} kernels, {per_kernel:.1f} µs of step per kernel): fewer launches "
            "(fusion, CUDA graphs: mode='reduce-overhead') or larger batches would help"
        )
    if split_ms["idle"] / step_ms > 0.2:
        return f"sync-bound: the device idles {100 * split_ms['idle'] / step_ms:.0f}% of the step in synchronizations"
    top = max(CATEGORIES[:4], key=lambda c: split_ms[c])
    return (
        f"healthy: the {'device' if busy_ms is not None else 'CPU'} works {100 * busy:.0f}% of the step, "
        f"host gaps {100 * host:.0f}%; most time in {top} ({100 * split_ms[top] / step_ms:.0f}%)"
    )


def build_step(workload: str, mode: str = "train", compiler: str = "ember", scale: str | None = None):
    """The bench's step of `workload`, compiled by `compiler`, and its inputs and device: compiled and
    warmed up, past the calls over which the default mode records and judges its CUDA graphs."""
    from ember.tools.bench import measure
    from ember.tools.bench.compilers import compile_fn
    from ember.tools.bench.workloads import WORKLOADS

    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    w = WORKLOADS[workload]
    if mode not in w.modes:
        raise ValueError(f"{workload} runs in modes {', '.join(w.modes)}, not {mode!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = scale or ("gpu" if device.type == "cuda" else "cpu")
    torch.manual_seed(0)
    built = w.instance(scale, device, mode)
    train = mode == "train"
    inputs = measure.prepare_inputs(built.inputs, train)
    step = measure.Step(compile_fn(built.fn, compiler), train, built.autocast, device)
    from ember.runtime.cudagraph_judge import SETTLING_CALLS

    for _ in range(SETTLING_CALLS if device.type == "cuda" else 3):  # compile, then warm
        step(*inputs)
    return step, inputs, device


def profile_workload(
    workload: str, mode: str = "train", compiler: str = "ember", scale: str | None = None, calls: int = 5, top: int = 10
) -> Profile:
    from torch.profiler import ProfilerActivity, profile, schedule

    from ember.tools.bench import measure
    from ember.tools.bench.profile import kernel_table

    step, inputs, device = build_step(workload, mode, compiler, scale)
    measure.sync(device)
    measure.quiet_kineto()
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=calls, repeat=1)) as prof:
        for _ in range(calls + 1):
            with torch.profiler.record_function("ember_profile_step"):
                step(*inputs)
                measure.sync(device)
            prof.step()
    events = prof.events()
    steps = [e for e in events if e.name == "ember_profile_step" and e.device_type.name == "CPU"]
    windows = merged([(e.time_range.start, e.time_range.end) for e in steps])
    step_us = _length(windows) / len(steps)
    others = [e for e in events if e.name != "ember_profile_step"]
    if cuda:
        split_us, busy_us = split_gpu(others, windows)
    else:
        split_us, busy_us = split_cpu(others, windows), None
    n = len(steps)
    split_ms = {c: split_us[c] / n / 1000 for c in CATEGORIES}
    table = kernel_table(others, cuda, n, top)
    result = Profile(workload, mode, compiler, str(device), step_us / 1000, split_ms, table["kernels_per_call"])
    result.top = table["top"]
    result.verdict = verdict(
        split_ms, step_us / 1000, None if busy_us is None else busy_us / n / 1000, result.kernels_per_step
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ember profile", description=__doc__.split("\n\n")[0])
    p.add_argument("workload", help="a bench workload (ember bench --list shows them), e.g. gpt2_blocks")
    p.add_argument("--mode", default="train", help="train or inference (default train)")
    p.add_argument("--compiler", default="ember", help="ember, ember:reduce-overhead, inductor or eager")
    p.add_argument("--scale", choices=["gpu", "cpu", "tiny"], help="the workload's size (default: the device's)")
    p.add_argument("--calls", type=int, default=5, help="steps profiled (default 5)")
    p.add_argument(
        "--top", type=int, default=10, help="kernels (GPU) or ops (CPU) listed, most time first (default 10)"
    )
    p.add_argument("--json", help="also write the profile as JSON to this file")
    p.add_argument(
        "--host", action="store_true", help="where the host's time per step goes, by layer (cProfile; --calls 50 suits)"
    )
    args = p.parse_args(argv)
    try:
        if args.host:
            return _print_host_profile(args)
        result = profile_workload(args.workload, args.mode, args.compiler, args.scale, args.calls, args.top)
    except ValueError as e:
        print(f"ember profile: {e}", file=sys.stderr)
        return 2
    print(result.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.__dict__, f, indent=1)
    return 0


def _print_host_profile(args) -> int:
    from ember.tools.bench import measure
    from ember.tools.host_profile import host_profile

    step, inputs, device = build_step(args.workload, args.mode, args.compiler, args.scale)
    result = host_profile(lambda: step(*inputs), args.calls, sync=lambda: measure.sync(device))
    print(f"{args.workload} {args.mode}, {args.compiler} on {device}, {args.calls} steps")
    print(result.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.__dict__, f, indent=1)
    return 0
