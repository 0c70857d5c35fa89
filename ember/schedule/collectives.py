"""Functional collectives in a schedule: where each starts, where it is waited on, what it holds.

A graph traced from torch.distributed code (functional collectives, tensor parallelism, compiled
FSDP) holds each collective as two ATen calls: the start (`_c10d_functional.all_reduce`,
`all_gather_into_tensor`, `reduce_scatter_tensor`, ...), which launches the communication and
returns at once, and `wait_tensor` on its result, which blocks until it is done. The importer
marks both extern nodes (attrs["collective"]: "start" or "wait"; aten/collectives.py). Between
the two, compute overlaps communication; so the ordering pass (order.py) under the setting
`overlap_collectives`:

- issues each start as soon as the steps computing its inputs have run, before any other ready
  step; starts keep their graph order among themselves (every rank issues its collectives in the
  program's order, however ember grouped the kernels around them);
- places each wait just before the first step that reads its result (the end of the program
  when only outputs do), and prefers, among the ready steps, those that read no pending wait's
  result, so that the compute independent of a collective runs while it is in flight.

Fusion (fusion.py) would undo some of that: a kernel computing a collective's input that also
computes its siblings delays the start, and a kernel after a wait that takes in independent
compute delays that compute past the wait; so would horizontal fusion (horizontal.py), packing
either into one launch. So under the same setting, `FusionBarriers` keeps the kernel computing a
start's input from merging with its siblings or consumers (and out of combo kernels), and a kernel
that depends on a wait's result from merging or sharing a launch with one that does not.

While a collective is in flight its inputs are still being read (all_gather on NCCL reads its
input on the communication stream): the memory plan keeps each start's inputs alive up to its
last wait (`hold_inputs`), so no kernel is placed in their memory before then.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.ir.graph import Graph, Node, Value
from ember.schedule.steps import ExternStep, KernelStep, Step, step_outputs


def role(step: Step) -> str | None:
    """A step's part in a functional collective: "start", "wait", or None."""
    if isinstance(step, ExternStep):
        return step.node.attrs.get("collective")
    return None


def _start_of(wait: Node) -> Node | None:
    """The start node a wait's operand comes from."""
    for v in wait.value_inputs():
        if v.node.attrs.get("collective") == "start":
            return v.node
    return None


@dataclass(frozen=True)
class FusionBarriers:
    """Which merges would delay a collective's start or pull independent compute past a wait."""

    start_inputs: frozenset  # values a collective start reads
    after_wait: frozenset  # values computed from a wait's result (directly or through other values)

    def feeds_start(self, roots) -> bool:
        return any(v in self.start_inputs for v in roots)

    def after_wait_of(self, roots) -> bool:
        return any(v in self.after_wait for v in roots)

    def keep_apart(self, a_roots, b_roots, siblings: bool) -> bool:
        """Whether groups with these roots stay apart: siblings, or `a` the producer of `b`."""
        if siblings:
            return (
                self.feeds_start(a_roots)
                or self.feeds_start(b_roots)
                or self.after_wait_of(a_roots) != self.after_wait_of(b_roots)
            )
        return self.feeds_start(a_roots) or (self.after_wait_of(b_roots) and not self.after_wait_of(a_roots))


def fusion_barriers(graph: Graph) -> FusionBarriers | None:
    """The barriers of a graph holding functional collectives (None without any)."""
    starts: set[Value] = set()
    after: set[Value] = set()
    for node in graph.nodes:
        kind = node.attrs.get("collective") if node.op == "extern" else None
        if kind == "start":
            starts |= set(node.value_inputs())
        if kind == "wait" or any(v in after for v in node.value_inputs()):
            after |= set(node.outputs)
    if not starts:
        return None
    return FusionBarriers(frozenset(starts), frozenset(after))


def hold_inputs(steps: list[Step], last: dict[Value, int]) -> None:
    """Extend the last use of each collective start's inputs to the last wait on its results."""
    waited: dict[int, int] = {}
    for pos, step in enumerate(steps):
        if role(step) == "wait":
            start = _start_of(step.node)
            if start is not None:
                waited[id(start)] = pos
    for step in steps:
        if role(step) == "start" and id(step.node) in waited:
            for v in step.node.value_inputs():
                last[v] = max(last.get(v, -1), waited[id(step.node)])


def describe(steps: list[Step]) -> list[str]:
    """One line per collective: the step that starts it, the step that waits on it, and the steps
    (kernels and other externs) that run between the two, for `ember.explain`."""
    lines = []
    wait_at: dict[int, int] = {}
    for pos, step in enumerate(steps):
        if role(step) == "wait":
            start = _start_of(step.node)
            if start is not None:
                wait_at.setdefault(id(start), pos)
    for pos, step in enumerate(steps):
        if role(step) != "start":
            continue
        node = step.node
        after = _name(steps[pos - 1]) if pos > 0 else "the program's start"
        end = wait_at.get(id(node))
        if end is None:
            lines.append(f"{node.origin}: starts at step {pos} (after {after}), never waited on in this graph")
            continue
        between = [s for s in steps[pos + 1 : end] if role(s) is None]
        # The step the wait precedes: past the other waits of a coalesced collective.
        later = [s for s in steps[end + 1 :] if role(s) != "wait"]
        before = _name(later[0]) if later else "the program's end"
        hidden = ", ".join(_name(s) for s in between[:6]) + (", ..." if len(between) > 6 else "")
        overlap = f"overlaps {len(between)} steps ({hidden})" if between else "overlaps nothing"
        lines.append(
            f"{node.origin} {_shape(step)}: starts at step {pos} (after {after}), waited at step {end} "
            f"(before {before}); {overlap}"
        )
    return lines


def _name(step: Step) -> str:
    if isinstance(step, KernelStep):
        return step.kernel.name
    if isinstance(step, ExternStep):
        return step.node.origin
    return f"alias {step.value.name}"


def _shape(step: ExternStep) -> str:
    outs = step_outputs(step)
    return " ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}" for v in outs)
