"""How much of a training step's communication runs under compute, from a torch.profiler trace.

From the events of one profiled step:

- communication: on a GPU, the NCCL kernels (`ncclDevKernel_*`, `ncclKernel_*`); on the CPU, gloo's
  work as its own threads record it (`gloo:all_reduce`, ...);
- compute: on a GPU, every other kernel and copy; on the CPU, the ATen operator events of the other
  threads (not waits or c10d calls). A compiled graph's own CPU kernels are not profiler events, so
  on the CPU compute is undercounted for Inductor and ember (only their ATen calls, such as matrix
  products, count) and their figure is a lower bound: read the GPU's.

The hidden fraction is the time during which both run, over the time communication runs (each side
first merged into disjoint intervals). `timeline_png` draws one step per compiler: a compute lane
and a communication lane.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Interval = tuple[float, float]  # start, end in microseconds

_COMM_WORDS = ("nccl", "gloo", "c10d", "wait", "record_param_comms")


def merged(intervals: list[Interval]) -> list[Interval]:
    """Disjoint, sorted intervals covering the same time."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in merged(intervals))


def intersection(a: list[Interval], b: list[Interval]) -> float:
    """Time covered by both sets of intervals."""
    a, b = merged(a), merged(b)
    i = j = 0
    both = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        both += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def lanes(events, cuda: bool) -> dict[str, list[Interval]]:
    """{"compute": [...], "comm": [...]} from a profile's events (`prof.events()`)."""
    compute: list[Interval] = []
    comm: list[Interval] = []
    if cuda:
        for e in events:
            if _gpu_work(e):
                span = (e.time_range.start, e.time_range.end)
                (comm if "nccl" in e.name.lower() else compute).append(span)
        return {"compute": compute, "comm": comm}
    comm_threads = {e.thread for e in events if e.name.startswith("gloo:")}
    for e in events:
        span = (e.time_range.start, e.time_range.end)
        if e.name.startswith("gloo:"):
            comm.append(span)
        elif e.thread not in comm_threads and e.name.startswith("aten::") and not any(w in e.name for w in _COMM_WORDS):
            compute.append(span)  # nested operators overlap their callers: the union counts each moment once
    return {"compute": compute, "comm": comm}


def summary(lane: dict[str, list[Interval]]) -> dict:
    """Milliseconds of compute, of communication, of both at once, and the hidden fraction."""
    comm, compute = total(lane["comm"]), total(lane["compute"])
    both = intersection(lane["comm"], lane["compute"])
    return {
        "compute_ms": compute / 1000,
        "comm_ms": comm / 1000,
        "overlap_ms": both / 1000,
        "exposed_comm_ms": (comm - both) / 1000,
        "hidden": both / comm if comm > 0 else None,
    }


def timeline_png(step_lanes: dict[str, dict[str, list[Interval]]], path: str, title: str) -> str | None:
    """One step per compiler, compute and communication lanes; returns a note instead where
    matplotlib is missing or nothing was recorded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no timeline PNG"
    rows = [(comp, lane) for comp, lane in step_lanes.items() if lane["compute"] or lane["comm"]]
    if not rows:
        return "no profiled events: no timeline PNG"
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.3 * len(rows) + 0.8), squeeze=False)
    for ax, (comp, lane) in zip(axes[:, 0], rows):
        start = min(s for spans in lane.values() for s, _ in spans)
        for y, (name, color) in enumerate((("compute", "tab:blue"), ("comm", "tab:orange"))):
            bars = [((s - start) / 1000, max((e - s) / 1000, 1e-4)) for s, e in merged(lane[name])]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=color)
        ax.set_yticks([0, 1], ["compute", "comm"])
        hidden = summary(lane)["hidden"]
        ax.set_title(f"{comp}: communication hidden {'n/a' if hidden is None else f'{hidden:.0%}'}", fontsize=9)
        ax.set_xlabel("ms from the step's first event", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_work(event) -> bool:
    """A kernel or copy that ran on the GPU. The profiler also projects user annotations onto the
    GPU's timeline (`DistributedDataParallel.forward`, `nccl:all_reduce`): ranges that span idle
    gaps and other kernels, so counting them would overstate compute and double communication."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def kernel_table(events, top: int = 20) -> list[dict]:
    """The GPU kernels and copies of a profile, by total time: name, calls, milliseconds (largest first).
    Set side by side for two runs, it shows which kernels a change of world size slowed."""
    totals: dict[str, list[float]] = {}
    for e in events:
        if _gpu_work(e):
            entry = totals.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += (e.time_range.end - e.time_range.start) / 1000
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"kernel": name[:160], "calls": calls, "ms": round(ms, 4)} for name, (calls, ms) in ranked]


_CALL_LABEL = "ember.bench.profiled_call"


def profile_call(call, device: torch.device, align=None) -> tuple[dict, list[dict]]:
    """The compute and communication lanes of one call under torch.profiler, and its kernel table.

    `align` (a barrier) runs inside the profile just before the call: each rank starts its profiler
    at its own moment, and without it the first collective's kernel would count the other rank's
    profiler start-up as communication. Only the events from the call's start on are kept."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        if align is not None:
            align()
            sync(device)
        with torch.profiler.record_function(_CALL_LABEL):
            call()
            sync(device)
    events = prof.events()
    starts = [e.time_range.start for e in events if e.name == _CALL_LABEL]
    if starts:
        events = [e for e in events if e.time_range.start >= starts[0] and e.name != _CALL_LABEL]
    cuda = device.type == "cuda"
    return lanes(events, cuda), kernel_table(events) if cuda else []


def across_ranks(value: float, op) -> float:
    """`value` reduced over every rank by `op` (a `dist.ReduceOp`), on the device the backend needs."""
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op)
    return t.item()


def slowest_rank(ms: float) -> float:
    """The largest of every rank's `ms` (a step is as slow as its slowest rank)."""
    return across_ranks(ms, dist.ReduceOp.MAX)
