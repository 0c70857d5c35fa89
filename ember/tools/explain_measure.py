"""Each kernel's measured time, and where it sits against the device's measured ceilings.

A step (the compiled function's call, and its backward when training) runs `calls` times after a warm-up:
- on the CPU, each generated kernel is timed where the host program calls it (its entry in the program's
  namespace is wrapped by a timer for those calls, then put back);
- on the GPU, under torch.profiler: a kernel's time is the device time of the CUDA kernel of its name.
ATen calls (externs: products, attention, ...) are timed through the profiler as ATen ops, with the
profiler's FLOP count for products and convolutions.

Per kernel: time, bytes and FLOPs (the cost model's, from the report), achieved GB/s and GFLOP/s, and the
percent of the roof that bounds it: min(bandwidth, FLOPs/byte x bandwidth, matmul rate) with the ceilings
measured by the bench (`measure.measure_ceilings`: a large copy, a large matmul).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ember.report import ExplainReport


@dataclass
class Ceilings:
    bandwidth: float  # bytes/s, a large copy (read + write)
    matmul: float  # FLOP/s, a large matmul of the step's dtype
    dtype: str
    device: str

    def roof(self, intensity: float | None) -> float:
        """The attainable FLOP/s at an arithmetic intensity (FLOPs per byte)."""
        if intensity is None:
            return self.matmul
        return min(self.matmul, intensity * self.bandwidth)


@dataclass
class Measured:
    name: str
    graph: str  # "forward", "backward", "inference", or "ATen" for externs
    us: float  # per step
    runs: float  # launches per step
    bytes: int | None = None
    flops: int | None = None
    kind: str = "kernel"  # "kernel" | "extern"
    ops: list[str] = field(default_factory=list)
    graph_index: int = -1  # the kernel's graph in the report (-1: an extern, by op over the step)

    @property
    def gbps(self) -> float | None:
        return None if self.bytes is None or self.us <= 0 else self.bytes / self.us / 1e3

    @property
    def gflops(self) -> float | None:
        return None if not self.flops or self.us <= 0 else self.flops / self.us / 1e3

    @property
    def intensity(self) -> float | None:
        return None if not self.bytes or self.flops is None else self.flops / self.bytes

    def percent_of_roof(self, c: Ceilings) -> float | None:
        """Achieved over attainable: bandwidth for a memory-bound kernel, FLOP rate for a compute-bound one."""
        if self.us <= 0:
            return None
        if self.bytes and (not self.flops or self.flops / self.bytes * c.bandwidth < c.matmul):
            return 100 * (self.bytes / (self.us * 1e-6)) / c.bandwidth
        if self.flops:
            return 100 * (self.flops / (self.us * 1e-6)) / c.matmul
        return None


def measure_ceilings(device: torch.device, dtype: torch.dtype, small: bool = False) -> Ceilings:
    from ember.tools.bench import measure

    found = measure.measure_ceilings(device, [dtype], "tiny" if small else "gpu")
    name = str(dtype).replace("torch.", "")
    return Ceilings(found["bandwidth_Bps"], found["flops"][name], name, str(device))


class _Timed:
    """A kernel's callable, timed on each call (the CPU runs it synchronously)."""

    def __init__(self, fn: Callable):
        self.fn, self.seconds = fn, []

    def __call__(self, *args):
        start = time.perf_counter()
        self.fn(*args)
        self.seconds.append(time.perf_counter() - start)

    def __getitem__(self, grid):  # Triton's kernel[grid](...) under its interpreter
        def launch(*args, **kwargs):
            start = time.perf_counter()
            self.fn[grid](*args, **kwargs)
            self.seconds.append(time.perf_counter() - start)

        return launch

    def per_step_us(self, steps: int) -> float:
        """The median call's time times the calls per step: other processes' time slices on a shared CPU
        land in a few calls, not in the median."""
        return statistics.median(self.seconds) * 1e6 * len(self.seconds) / steps if self.seconds else 0.0


def measure_step(
    report: ExplainReport,
    step: Callable[[], object],
    device: torch.device,
    calls: int = 10,
    symbols: dict[tuple[int, str], str] | None = None,
) -> list:
    """Measured kernels (ember's, per graph) and externs (ATen ops) of one step, per step. `symbols`: the
    device function each kernel's launches run (layers.KernelLayers.symbol), by (graph index, kernel
    name); kernels that share one (equal programs, one binary) share its time equally."""
    step()  # warm: caches, lazily compiled backward
    cuda = device.type == "cuda"
    timers: dict[tuple[int, str], _Timed] = {}
    if not cuda:
        for gi, g in enumerate(report.graphs):
            for k in g.kernels if g.namespace is not None else []:
                fn = g.namespace.get(k.name)
                if fn is not None:
                    timers[gi, k.name] = g.namespace[k.name] = _Timed(fn)
    try:
        events = _profiled(step, calls, cuda)
    finally:
        for (gi, name), timed in timers.items():
            report.graphs[gi].namespace[name] = timed.fn
    device_us = _device_kernel_us(events) if cuda else {}
    symbols = symbols or {}
    of = {(gi, k.name): symbols.get((gi, k.name), k.name) for gi, g in enumerate(report.graphs) for k in g.kernels}
    sharing = {s: list(of.values()).count(s) for s in set(of.values())}
    out = []
    for gi, g in enumerate(report.graphs):
        for k in g.kernels:
            if cuda:
                symbol = of[gi, k.name]
                us, runs = device_us.get(symbol, (0.0, 0))
                us, runs = us / sharing[symbol], runs / sharing[symbol]
            else:
                t = timers.get((gi, k.name))
                us, runs = (t.per_step_us(1), len(t.seconds)) if t is not None else (0.0, 0)
            m = Measured(k.name, g.kind, us / calls, runs / calls, k.bytes, k.flops, "kernel", list(k.ops), gi)
            out.append(m)
    extern_names = {e for g in report.graphs for e in g.externs}
    out += _externs(events, extern_names, cuda, calls)
    return out


def _profiled(step: Callable, calls: int, cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    from ember.tools.bench import measure

    measure.quiet_kineto()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_flops=True) as prof:
        for _ in range(calls):
            step()
        if cuda:
            torch.cuda.synchronize()
    return prof.events()


def _device_kernel_us(events) -> dict[str, tuple[float, int]]:
    seen: dict[str, list] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = seen.setdefault(e.name, [0.0, 0])
            entry[0] += e.device_time
            entry[1] += 1
    return {n: (us, runs) for n, (us, runs) in seen.items()}


def _externs(events, names: set[str], cuda: bool, calls: int) -> list[Measured]:
    """The ATen ops ember calls (by op name), each timed as the profiler saw it: device time on a GPU,
    the op's own CPU time otherwise; FLOPs where the profiler counts them (products, convolutions)."""
    totals: dict[str, list] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith("aten::"):
            continue
        op = e.name.removeprefix("aten::")
        if op not in names:
            continue
        entry = totals.setdefault(op, [0.0, 0, 0])
        entry[0] += e.device_time_total if cuda else e.cpu_time_total
        entry[1] += 1
        entry[2] += getattr(e, "flops", 0) or 0
    return [
        Measured(op, "ATen", us / calls, n / calls, None, int(flops / calls) if flops else None, "extern", [op])
        for op, (us, n, flops) in sorted(totals.items(), key=lambda kv: -kv[1][0])
    ]


def table(measured: list, ceilings: Ceilings) -> str:
    """The measurements as a text table, the slowest first."""
    lines = [
        (
            f"ceilings ({ceilings.device}): copy {ceilings.bandwidth / 1e9:.1f} GB/s, "
            f"{ceilings.dtype} matmul {ceilings.matmul / 1e9:.1f} GFLOP/s (measured)"
        ),
        (
            f"{'name':<14}{'graph':<10}{'us/step':>10}{'runs':>6}{'MB':>10}{'MFLOP':>10}{'GB/s':>9}"
            f"{'GFLOP/s':>9}{'% roof':>8}  ops"
        ),
    ]

    def num(v, fmt):
        return format("-", f">{fmt.split('.')[0]}") if v is None else format(v, fmt)

    for m in sorted(measured, key=lambda m: -m.us):
        mb = None if m.bytes is None else m.bytes / 1e6
        mflop = None if m.flops is None else m.flops / 1e6
        lines.append(
            f"{m.name[:13]:<14}{m.graph:<10}{m.us:>10.1f}{m.runs:>6.1f}{num(mb, '10.3f')}{num(mflop, '10.3f')}"
            f"{num(m.gbps, '9.1f')}{num(m.gflops, '9.1f')}{num(m.percent_of_roof(ceilings), '8.1f')}  "
            f"{' + '.join(m.ops)[:60]}"
        )
    return "\n".join(lines)
