"""Functional collectives in the schedule, device-free: the graph is traced with fake tensors (no
process group), imported and scheduled, and the order of the steps inspected.

Under `overlap_collectives` (the default) each collective starts right after the step computing
its input and is waited on just before the first step reading its result, the independent compute
running in between; starts keep the program's order; the memory plan places nothing in a
collective's input before its wait; neither fusion nor combo kernels put independent compute into
the kernel computing a collective's input. Off, the steps keep the graph's order (each wait right after
its start, as Dynamo traces `wait_tensor(all_reduce(x))`)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ember import config
from ember.aten.importer import import_graph
from ember.schedule import collectives
from ember.schedule.scheduler import schedule
from ember.schedule.steps import ExternStep, KernelStep, step_inputs, step_outputs
from ember.target import Heuristics, Target

c10d = torch.ops._c10d_functional


def program(x, w):
    """Three collectives, each waited on at once, as a traced program holds them; compute
    independent of each follows it."""
    reduced = c10d.wait_tensor(c10d.all_reduce(x @ w, "sum", "0"))
    h = torch.relu(x * 2) @ w
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(h, 2, "0"))
    scattered = c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.sin(h), "sum", 2, "0"))
    tail = torch.tanh(h * 3) @ w
    return reduced + 1, gathered * 2, scattered.cos(), tail


def only_output(x, w):
    """A collective whose result is only returned (a gradient bucket's all_reduce)."""
    return c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", "0")), torch.exp(x) @ w


def siblings(x, w):
    """The collective's input and six independent values all read x: fused or packed with the input's
    kernel, they would delay the start."""
    reduced = c10d.wait_tensor(c10d.all_reduce(x * 3, "sum", "0"))
    return reduced + 1, *[torch.sin(x + i) for i in range(6)]


# A target whose horizontal fusion packs small independent kernels into one launch (as a GPU's does).
PACKING = Target("triton", heuristics=Heuristics())


def scheduled(fn, overlap: bool = True, target: Target | None = None):
    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 16))
    with config.override(overlap_collectives=overlap):
        return schedule(import_graph(gm, torch.device("cpu")), target=target)


def names(steps) -> list[str]:
    return [s.node.origin if isinstance(s, ExternStep) else s.kernel.name for s in steps if not _alias(s)]


def _alias(step) -> bool:
    return not isinstance(step, (ExternStep, KernelStep))


def positions(steps, role: str) -> list[int]:
    return [k for k, s in enumerate(steps) if collectives.role(s) == role]


def test_each_start_follows_its_input_and_each_wait_precedes_its_first_reader():
    steps = scheduled(program).steps
    order = names(steps)
    starts, waits = positions(steps, "start"), positions(steps, "wait")
    assert [steps[k].node.origin for k in starts] == ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]
    for k in starts:
        produced = {v for s in steps[:k] for v in step_outputs(s)}
        (operand,) = steps[k].node.value_inputs()
        assert operand in set(step_outputs(steps[k - 1])), f"start {k} not right after its input's step: {order}"
        assert operand in produced
    for k in waits:
        result = set(step_outputs(steps[k]))
        assert not any(result & set(step_inputs(s)) for s in steps[:k])
        assert result & set(step_inputs(steps[k + 1])), f"wait at {k} not right before its first reader: {order}"
    # Compute runs while each collective is in flight (the waits moved past independent kernels).
    for start in starts:
        wait = min(w for w in waits if w > start)
        between = [s for s in steps[start + 1 : wait] if isinstance(s, KernelStep) or collectives.role(s) is None]
        assert between, f"nothing between the start at {start} and its wait: {order}"
    # The all_reduce's wait comes after the tanh product that the program wrote after it.
    assert waits[0] > order.index("mm", order.index("all_reduce") + 2), order


def test_collective_input_not_reused_before_its_wait():
    sched = scheduled(program)
    steps, plan = sched.steps, sched.memory
    for start in positions(steps, "start"):
        wait = min(w for w in positions(steps, "wait") if w > start)
        held = set(steps[start].node.value_inputs())
        for s in steps[start + 1 : wait]:
            for v in step_outputs(s):
                donor = plan.reuse.get(v)
                assert donor not in held, f"{v.name} placed in {donor.name}, read by a collective still in flight"


def test_wait_of_a_returned_result_goes_last():
    steps = scheduled(only_output).steps
    order = names(steps)
    assert order[-1] == "wait_tensor", order
    assert order.index("all_reduce") < order.index("mm"), order


@pytest.mark.parametrize("fn", [program, only_output])
def test_overlap_off_keeps_graph_order(fn):
    steps = scheduled(fn, overlap=False).steps
    for k in positions(steps, "start"):
        assert collectives.role(steps[k + 1]) == "wait", names(steps)


def test_explain_lines_name_start_wait_and_overlapped_steps():
    lines = collectives.describe(scheduled(program).steps)
    assert len(lines) == 3, lines
    assert lines[0].startswith("all_reduce float32[8, 16]: starts at step"), lines
    assert all("waited at step" in line and "overlaps" in line and "overlaps nothing" not in line for line in lines)


@pytest.mark.parametrize("target", [None, PACKING], ids=["no-combo", "combo"])
def test_kernel_feeding_a_collective_computes_only_its_input(target):
    steps = scheduled(siblings, target=target).steps
    order = names(steps)
    (start,) = positions(steps, "start")
    (wait,) = positions(steps, "wait")
    feeding = steps[start - 1]
    assert isinstance(feeding, KernelStep), order
    assert feeding.kernel.writes == steps[start].node.value_inputs(), f"{feeding.kernel.name} computes more: {order}"
    between = [s for s in steps[start + 1 : wait] if isinstance(s, KernelStep)]
    assert between, f"the sines do not run while the all_reduce is in flight: {order}"


@pytest.mark.parametrize("target", [None, PACKING], ids=["no-combo", "combo"])
def test_overlap_off_fuses_as_before(target):
    """Without the setting the input's kernel takes in its siblings again: one kernel before the start."""
    steps = scheduled(siblings, overlap=False, target=target).steps
    kernels_before = [s for s in steps[: positions(steps, "start")[0]] if isinstance(s, KernelStep)]
    assert len(kernels_before) == 1 and len(kernels_before[0].kernel.writes) > 1, names(steps)


def coalesced(x, w):
    """One start, two results, a wait on each."""
    a, b = c10d.all_reduce_coalesced([x * 2, x + 1], "sum", "0")
    return c10d.wait_tensor(a) + c10d.wait_tensor(b), torch.tanh(x @ w)


def test_coalesced_collective_overlaps_and_holds_both_inputs():
    sched = scheduled(coalesced)
    steps = sched.steps
    (start,) = positions(steps, "start")
    waits = positions(steps, "wait")
    assert len(waits) == 2 and "mm" in names(steps[start + 1 : waits[0]]), names(steps)
    held = set(steps[start].node.value_inputs())
    assert len(held) == 2
    for s in steps[start + 1 : waits[-1]]:
        assert not any(sched.memory.reuse.get(v) in held for v in step_outputs(s))
    (line,) = collectives.describe(steps)
    assert line.startswith("all_reduce_coalesced float32[8, 16] float32[8, 16]: starts at step") and "(before k" in line
