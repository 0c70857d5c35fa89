"""GEMM planning: which matrix products ember's GEMM template runs (gemm.py decides, per product).

Each chosen product is realized, as a group of its own whose kernel computes the product;
pointwise consumers may then fuse into it as its epilogue. Every product looked at leaves a
decision for the fusion log: the template or ATen, and why.
"""

from __future__ import annotations

from ember.ir.graph import Value, layout_of
from ember.schedule.gemm import plan_gemms
from ember.schedule.state import ScheduleState
from ember.schedule.steps import FusionDecision


def plan_gemm_templates(state: ScheduleState) -> None:
    graph = state.graph

    def operand_strides(v: Value) -> tuple:
        """The layout of the tensor the host program holds for v: an alias's, or v's own."""
        return state.aliases[v].stride if v in state.aliases else layout_of(v)

    state.gemm_plans, notes = plan_gemms(graph.nodes, state.gemm, operand_strides, graph.device)
    for what, chosen, why in notes:
        state.decisions.append(FusionDecision(what, "GEMM template" if chosen else "ATen", chosen, why))
    outs = [p.out for p in state.gemm_plans.values()]
    # A product the graph returns or an extern reads is stored whatever fuses into it.
    read = {o for o in graph.outputs if isinstance(o, Value)}
    read |= {v for node in graph.nodes if state.is_extern(node) for v in node.value_inputs()}
    state.read_outside |= read & set(outs)
    state.realized += outs
