"""Peak memory of one call of a step: the GPU's allocator peak with the step's CUDA-graph pools
counted, or on the CPU an estimate from torch.profiler's memory events."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ember.tools.bench.measure import quiet_kineto, sync


def peak_memory_mb(step: Callable, inputs: tuple, device: torch.device, pools: frozenset = frozenset()) -> float | None:
    """The most memory allocated during one call, over what was allocated before it (MB).

    GPU: the caching allocator's peak. The private memory pools of the step's CUDA graphs (`pools`,
    as `graph_pools` finds them) are the step's own memory, held from their recording on, which no
    other allocation can use: their blocks count whole (those allocated before the call are left
    out of the base, the free ones are added), so a compiler that replays graphs is not measured
    below one that does not. CPU: PyTorch keeps no CPU peak,
    so the call runs under torch.profiler with profile_memory, and the peak is the running sum of
    the ops' allocations and frees in time order (an estimate at op granularity; memory allocated
    outside PyTorch's allocator, e.g. inside a C++ kernel, is not seen).
    """
    if device.type != "cuda":
        return _cpu_peak_mb(step, inputs)
    sync(device)
    pooled_before, _ = _private_pool_bytes(device, pools)
    base = torch.cuda.memory_allocated(device) - pooled_before
    torch.cuda.reset_peak_memory_stats(device)
    out = step(*inputs)
    sync(device)
    _, pool_free = _private_pool_bytes(device, pools)
    peak = torch.cuda.max_memory_allocated(device) - base + pool_free
    del out
    return peak / 1e6


def _private_pool_bytes(device: torch.device, pools: frozenset) -> tuple[int, int]:
    """(allocated, free) bytes of these private memory pools on the device (the caching allocator's
    snapshot marks each segment with its pool)."""
    if not pools:
        return 0, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    allocated = free = 0
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != index or tuple(segment.get("segment_pool_id") or ()) not in pools:
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "active_allocated":
                allocated += block["size"]
            else:
                free += block["size"]
    return allocated, free


def graph_pools(compiler: str, device: torch.device) -> frozenset:
    """The private memory pools of a compiler's CUDA graphs on the device: ember's default mode records
    into a pool of its own, its reduce-overhead and max-autotune into another; Inductor's CUDA graph
    trees (reduce-overhead, max-autotune) keep one per device."""
    if device.type != "cuda":
        return frozenset()
    name, _, mode = compiler.partition(":")
    graphs_asked = mode in ("reduce-overhead", "max-autotune")
    if name == "ember":
        from ember.runtime.cudagraph_pool import live_pools

        # A pool none of whose recordings is alive is only cached memory: the allocator frees it when it
        # runs short, as it does its own cache, which no compiler's peak counts.
        return frozenset(
            tuple(p.handle)
            for p in live_pools()
            if p.with_steps == graphs_asked and any(not r.released for r in p.recordings)
        )
    if name == "inductor" and graphs_asked:
        from torch._inductor import cudagraph_trees

        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = getattr(cudagraph_trees.get_container(index), "tree_manager", None)
        handle = getattr(manager, "cuda_graphs_thread_pool", None)
        return frozenset([tuple(handle)]) if handle is not None else frozenset()
    return frozenset()


def _cpu_peak_mb(step: Callable, inputs: tuple) -> float | None:
    from torch.profiler import ProfilerActivity, profile

    quiet_kineto()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = step(*inputs)
            del out
        # An op's own (self) memory is net of its allocations and frees: count a net allocation
        # at the op's start and a net free at its end (a composite op frees its children's
        # temporaries after they return), and the allocator's "[memory]" records where they happen.
        deltas = []
        for e in prof.events():
            if e.name == "[memory]":
                deltas.append((e.time_range.start, e.cpu_memory_usage))
            elif e.self_cpu_memory_usage:
                m = e.self_cpu_memory_usage
                deltas.append((e.time_range.start if m > 0 else e.time_range.end, m))
        current = peak = 0
        for _, m in sorted(deltas, key=lambda d: (d[0], -d[1])):  # at a tie, allocations first
            current += m
            peak = max(peak, current)
    except Exception:  # noqa: BLE001 - a profiler failure costs the number, not the run
        return None
    return peak / 1e6
