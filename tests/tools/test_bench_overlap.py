"""The distributed bench's overlap figures (tools/bench/overlap.py): interval arithmetic on made-up
profiles, and the lanes read from a real CPU profile's events."""

from __future__ import annotations

import pytest

from ember.tools.bench import overlap


def test_merged_and_total():
    assert overlap.merged([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert overlap.total([(0, 2), (1, 3), (10, 11)]) == 4


@pytest.mark.parametrize(
    "comm,compute,hidden",
    [
        ([(0, 10)], [(0, 10)], 1.0),  # all of it under compute
        ([(0, 10)], [(10, 20)], 0.0),  # none: compute waits for the collective
        ([(0, 10), (20, 30)], [(5, 25)], 0.5),  # half of each of two collectives
        ([(0, 4)], [(0, 1), (0, 1), (3, 5)], 0.5),  # overlapping compute intervals count once
    ],
)
def test_hidden_fraction(comm, compute, hidden):
    s = overlap.summary({"comm": comm, "compute": compute})
    assert s["hidden"] == pytest.approx(hidden)
    assert s["exposed_comm_ms"] == pytest.approx((1 - hidden) * overlap.total(comm) / 1000)


def test_no_communication_has_no_fraction():
    assert overlap.summary({"comm": [], "compute": [(0, 1)]})["hidden"] is None


def test_cpu_lanes_from_profiler_events():
    """On the CPU, gloo's work threads are the communication and ATen operators elsewhere compute (an operator
    with children counts whole; a module's or a c10d call's range does not)."""

    class Range:
        def __init__(self, start, end):
            self.start, self.end = start, end

    class Event:
        def __init__(self, name, thread, start, end, children=()):
            self.name, self.thread, self.time_range, self.cpu_children = name, thread, Range(start, end), list(children)

    mm = Event("aten::mm", 1, 2, 6, [Event("aten::resolve_conj", 1, 2, 3)])
    events = [
        Event("DistributedDataParallel.forward", 1, 0, 10, [mm]),
        mm,
        Event("c10d::allreduce_", 1, 6, 7),
        Event("gloo:all_reduce", 2, 4, 12),
    ]
    lanes = overlap.lanes(events, cuda=False)
    assert lanes["comm"] == [(4, 12)] and overlap.merged(lanes["compute"]) == [(2, 6)], lanes
    assert overlap.summary(lanes)["hidden"] == pytest.approx(2 / 8)


def test_gpu_lanes_and_kernel_table_leave_out_user_annotations():
    """On a GPU the profiler projects user annotations (a module's forward, `nccl:all_reduce`) onto the device's
    timeline; they span idle gaps and other kernels, so neither the lanes nor the kernel table count them."""
    import types

    import torch

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda, annotation=False):
        span = types.SimpleNamespace(start=start, end=end)
        return types.SimpleNamespace(
            name=name, time_range=span, device_type=device, is_user_annotation=annotation, thread=0
        )

    events = [
        event("DistributedDataParallel.forward", 0, 5000, annotation=True),
        event("nccl:all_reduce", 3000, 4000, annotation=True),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 3000, 4000),
        event("gemm", 0, 1000),
        event("gemm", 1500, 2500),
        event("aten::mm", 0, 900, device=cpu),
    ]
    lanes = overlap.lanes(events, cuda=True)
    assert lanes == {"compute": [(0, 1000), (1500, 2500)], "comm": [(3000, 4000)]}
    assert overlap.summary(lanes)["hidden"] == 0.0  # the annotation over it is not compute
    table = overlap.kernel_table(events)
    assert [(k["kernel"], k["calls"], k["ms"]) for k in table] == [
        ("gemm", 2, 2.0),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1, 1.0),
    ]
