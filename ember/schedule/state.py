"""The scheduler's state: one record that every scheduling pass reads and fills in.

scheduler.py runs the passes in order; each fills in its fields: realize.py `aliases`,
`realized` and `read_outside`; gemm_plan.py `gemm_plans`; groups.py `groups`, `owner` and
`gemms`; fusion.py (with merge.py) merges groups and fills in `readers`, `decisions` and
`sibling_merged`; order.py `steps`; memory.py `memory`; horizontal.py may replace `steps`
and `memory`.

The record is the scheduler's working memory. Its result, `steps.Schedule`, keeps only the
graph, the steps, the decisions and the memory plan (the schedule cache pickles it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.ir.graph import Graph, Node, Value
from ember.schedule.gemm import GemmChooser, GemmGroups, GemmOp
from ember.schedule.kernel import Domain, Gather, IndexedStore, Kernel
from ember.schedule.memory import MemoryPlan
from ember.schedule.steps import AliasStep, FusionDecision, Schedule, Step
from ember.target import Heuristics, HorizontalHeuristics, Target

# The target of a schedule made for none in particular (schedule(graph) alone, as device-free tests
# call it): it renders no special kernel form (no online softmax, no column partials) and
# combines no launches.
NO_TARGET = Target("none", heuristics=Heuristics(horizontal=HorizontalHeuristics(max_parts=1)))


@dataclass
class Group:
    """Values computed by one kernel over one domain; fusion merges groups."""

    id: int
    domain: Domain
    roots: list[Value]
    first: int  # position of its first node in the graph, for stable ordering
    kernel: Kernel | None = None


@dataclass
class ScheduleState:
    graph: Graph
    target: Target = NO_TARGET  # what the code generator renders (online_softmax, column_partials), its heuristics
    gemm: GemmChooser | None = None  # the backend's template-or-ATen choice per product (None: no template)
    # Kernel names are `kernel_prefix` + group id: a training step's forward and backward graphs
    # name theirs apart ("fk3", "bk3"), so a profile's kernel names say which graph ran them.
    kernel_prefix: str = "k"
    position: dict[int, int] = field(default_factory=dict)  # id(node) -> its place in graph.nodes
    aliases: dict[Value, AliasStep] = field(default_factory=dict)  # views kept as strided views of a buffer
    realized: list[Value] = field(default_factory=list)  # values in memory, in the order their groups are made
    # Stored whatever fuses: returned, read by an extern, or the base of an alias.
    read_outside: set[Value] = field(default_factory=set)
    # A scatter into a graph input that a kernel stores (indexed_store.py): the input's new value -> how.
    indexed_stores: dict[Value, IndexedStore] = field(default_factory=dict)
    # A gather that kernels compute where they read it (gathers.py): its value -> how.
    gathers: dict[Value, Gather] = field(default_factory=dict)
    gemm_plans: dict[int, GemmOp] = field(default_factory=dict)  # id(extern node) -> product run as the template
    gemms: GemmGroups = field(default_factory=GemmGroups)  # template groups and their merge rule
    groups: dict[int, Group] = field(default_factory=dict)
    owner: dict[Value, int] = field(default_factory=dict)  # realized value -> id of the group computing it
    readers: dict[Value, set[int]] = field(default_factory=dict)  # value -> ids of the groups loading it
    decisions: list[FusionDecision] = field(default_factory=list)
    sibling_merged: set[int] = field(default_factory=set)  # ids of groups a sibling merge made
    steps: list[Step] = field(default_factory=list)
    memory: MemoryPlan | None = None

    def __post_init__(self) -> None:
        self.position = {id(n): k for k, n in enumerate(self.graph.nodes)}

    def kernel_name(self, gid: int) -> str:
        return f"{self.kernel_prefix}{gid}"

    def is_extern(self, node: Node) -> bool:
        """An extern step: an ATen call that neither the GEMM template, an indexed store nor a gather
        takes over."""
        if node.op != "extern" or id(node) in self.gemm_plans:
            return False
        return not (node.outputs and (node.outputs[0] in self.indexed_stores or node.outputs[0] in self.gathers))

    def computed_by_kernel(self, v: Value) -> bool:
        """Whether a kernel computes v: not a graph input, nor an ATen call's result (unless an indexed
        store or a gather takes the call over)."""
        if v.node.op == "input":
            return False
        return v.node.op != "extern" or v in self.indexed_stores or v in self.gathers

    def needed_outside(self, v: Value, members: set[int]) -> bool:
        """Whether a kernel made of the groups `members` must store v: someone outside reads it."""
        return v in self.read_outside or bool(self.readers.get(v, set()) - members)

    def update_readers(self) -> None:
        """`readers` from every group's kernel."""
        readers: dict[Value, set[int]] = {}
        for g in self.groups.values():
            for v in g.kernel.reads:
                readers.setdefault(v, set()).add(g.id)
        self.readers = readers

    def result(self) -> Schedule:
        return Schedule(self.graph, self.steps, self.decisions, self.memory)
