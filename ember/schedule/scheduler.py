"""From a graph to an ordered schedule of kernels, extern calls and aliases: the list of passes.

Each pass reads and fills in one record, state.ScheduleState; each module holds one pass:

0. indexed_store.py: scatters that kernels store (a KV cache's update) or add atomically (a scatter-add);
   gathers.py: gathers that kernels compute where they read them (index_select, embedding);
1. realize.py: which values live in memory (outputs, extern inputs, reductions, aliases of views);
2. gemm_plan.py: which matrix products ember's GEMM template runs, each realized in a group of its own;
3. realize.py: pointwise values cheaper computed once (read by several kernels, or broadcast transcendental work);
4. groups.py: one group, with its kernel (kernel_builder.py), per realized value;
5. fusion.py (merge.py): merge groups, the pair saving the most bytes first;
6. order.py: store only what another step reads; order the steps topologically;
7. memory.py: place each buffer (in place, a dead buffer, or fresh memory); the planned peak;
8. horizontal.py: groups of independent small pointwise kernels, each group one launch.

peak.py runs the passes again with fewer sibling merges where those raised the planned peak
above eager's.
"""

from __future__ import annotations

from ember import config
from ember.ir.graph import Graph
from ember.schedule.fusion import FusionPolicy, fuse
from ember.schedule.gathers import plan_gathers
from ember.schedule.gemm import GemmChooser
from ember.schedule.gemm_plan import plan_gemm_templates
from ember.schedule.groups import make_groups
from ember.schedule.horizontal import combine_horizontally
from ember.schedule.indexed_store import plan_indexed_stores
from ember.schedule.kernel_builder import room_for_depth
from ember.schedule.memory import eager_peak as eager_peak_bytes
from ember.schedule.memory import plan_memory
from ember.schedule.order import order_steps
from ember.schedule.peak import keep_under_eager_peak
from ember.schedule.realize import realize_shared, realize_stored
from ember.schedule.state import NO_TARGET, ScheduleState
from ember.schedule.steps import Schedule
from ember.target import Target


def schedule(
    graph: Graph,
    eager_peak: int | None = None,
    target: Target | None = None,
    gemm: GemmChooser | None = None,
    kernel_prefix: str = "k",
) -> Schedule:
    """Schedule the graph. If sibling merges would raise the planned peak above eager's
    (`eager_peak`: of the graph as imported, before any pass; default: of `graph`), undo them
    (peak.py). `target` (ember/target.py) says which kernel forms its code generator renders: a
    long row's max and sum of exp folded into one pass (`online_softmax`, schedule/online.py), and
    row kernels that accumulate split column sums (`column_partials`, kernel.KColumnPartial), and
    which independent kernels share a launch (`heuristics.horizontal`, horizontal.py); None: none
    (state.NO_TARGET). `gemm`: the backend's choice between its GEMM template and ATen per matrix
    product (schedule/gemm.py). `kernel_prefix` starts every kernel's name."""
    renders = target if target is not None else NO_TARGET
    room_for_depth(len(graph.nodes))  # a kernel's expression walk can pass every value of the graph
    if eager_peak is None:
        eager_peak = eager_peak_bytes(graph)

    def reschedule(policy: FusionPolicy) -> ScheduleState:
        state = ScheduleState(graph, renders, gemm, kernel_prefix)
        run_passes(state, eager_peak, policy)
        return state

    policy = FusionPolicy(rank_every_pair=config.get("fusion_rank_every_pair"))
    return keep_under_eager_peak(reschedule(policy), reschedule, policy).result()


def run_passes(state: ScheduleState, eager_peak: int | None, policy: FusionPolicy) -> None:
    """The scheduling passes, once, in order, over a state that holds only the graph and its target."""
    plan_indexed_stores(state)
    plan_gathers(state)
    realize_stored(state)
    plan_gemm_templates(state)
    realize_shared(state)
    make_groups(state)
    if config.get("fuse"):
        fuse(state, policy)
    order_steps(state)
    state.memory = plan_memory(state.graph, state.steps, eager_peak)
    combine_horizontally(state, eager_peak)
