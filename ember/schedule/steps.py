"""The Schedule: ordered steps (Kernel | Extern call | View/alias) and what each reads and writes."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.ir.graph import Graph, Node, Value
from ember.schedule.kernel import Kernel


@dataclass
class KernelStep:
    kernel: Kernel


@dataclass
class ExternStep:
    node: Node


@dataclass
class AliasStep:
    """A view of a buffer that must exist as a tensor (an output or an extern input)."""

    value: Value
    base: Value
    stride: tuple
    offset: object


Step = KernelStep | ExternStep | AliasStep


@dataclass
class FusionDecision:
    """One considered merge, for `EMBER_LOGS=fusion` and reports."""

    consumer: str
    producer: str
    accepted: bool
    reason: str
    saved_bytes: int | None = None  # device-memory bytes the merge saves (None: symbolic / not built)


@dataclass
class Schedule:
    graph: Graph
    steps: list[Step]
    decisions: list[FusionDecision] = field(default_factory=list)
    memory: object = None  # the MemoryPlan (schedule/memory.py)
    # Each kernel's cost (schedule/cost.py: kernel_cost) by name, for reports: worked out once with
    # the schedule and kept in its pickle, so a graph loaded from a cache does not work it out again.
    costs: dict = field(default_factory=dict)

    @property
    def kernels(self) -> list[Kernel]:
        return [s.kernel for s in self.steps if isinstance(s, KernelStep)]

    @property
    def externs(self) -> list[Node]:
        return [s.node for s in self.steps if isinstance(s, ExternStep)]


def step_inputs(step: Step) -> list[Value]:
    if isinstance(step, KernelStep):
        return list(step.kernel.reads)
    if isinstance(step, ExternStep):
        return step.node.value_inputs()
    return [step.base]


def step_outputs(step: Step) -> list[Value]:
    if isinstance(step, KernelStep):
        return step.kernel.writes
    if isinstance(step, ExternStep):
        return step.node.outputs
    return [step.value]


def may_alias(node: Node) -> bool:
    """Whether an extern's results may share storage with its inputs (a view-returning op).
    ember's own targets say so with `fresh_result`; an ATen op by its schema's alias
    annotations; anything else may."""
    if getattr(node.attrs["target"], "fresh_result", False):
        return False
    schema = getattr(node.attrs["target"], "_schema", None)
    if schema is None:
        return True
    return any(r.alias_info is not None for r in schema.returns)
