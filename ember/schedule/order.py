"""Order: the schedule's steps, each after the steps computing what it reads.

Each group's kernel is built a last time, storing only the values another step reads (the
rest stay in registers). Kernels and extern calls are ordered topologically, ties broken by
their place in the graph; an alias follows the step that computes its base, and aliases of
graph inputs come first.
"""

from __future__ import annotations

from ember.ir.graph import Value
from ember.schedule.groups import group_kernel
from ember.schedule.state import ScheduleState
from ember.schedule.steps import ExternStep, KernelStep, Step, step_outputs


def order_steps(state: ScheduleState) -> None:
    state.update_readers()  # which group values does anyone outside their own group read?
    items = _steps_and_needs(state)
    produced_by: dict[Value, int] = {}
    for k, (_, step, _) in enumerate(items):
        for v in step_outputs(step):
            produced_by[v] = k
    # Topological order, ties broken by graph position (Kahn's algorithm).
    deps = [{produced_by[v] for v in needs if v in produced_by} - {k} for k, (_, _, needs) in enumerate(items)]
    done: set[int] = set()
    order: list[Step] = []
    while len(done) < len(items):
        ready = [k for k in range(len(items)) if k not in done and deps[k] <= done]
        if not ready:
            stuck = [
                (_describe(items[k][1]), sorted(_describe(items[d][1]) for d in deps[k] - done))
                for k in range(len(items))
                if k not in done
            ]
            raise RuntimeError(f"schedule has a cycle among {stuck}")
        k = min(ready, key=lambda k: items[k][0])
        done.add(k)
        order.append(items[k][1])
        outs = set(step_outputs(items[k][1]))
        order.extend(a for a in state.aliases.values() if a.base in outs)
    order[:0] = [a for a in state.aliases.values() if a.base.node.op == "input"]
    state.steps = order


def _steps_and_needs(state: ScheduleState) -> list[tuple[int, Step, set]]:
    """(position, step, the values it needs) for each kernel, with its final kernel, and each extern call."""
    items: list[tuple[int, Step, set]] = []
    aliases = state.aliases
    for g in state.groups.values():
        stored = [v for v in g.roots if state.needed_outside(v, {g.id})]
        g.kernel = group_kernel(state, g.domain, g.id, g.roots, stored)
        # A template reads its operands as tensors: an aliased operand needs its base's producer.
        needs = {aliases[v].base if v in aliases else v for v in g.kernel.reads}
        items.append((g.first, KernelStep(g.kernel), needs))
    for node in state.graph.nodes:
        if state.is_extern(node):
            needs = {aliases[v].base if v in aliases else v for v in node.value_inputs()}
            items.append((state.position[id(node)], ExternStep(node), needs))
    return items


def _describe(step: Step) -> str:
    if isinstance(step, KernelStep):
        return step.kernel.name
    if isinstance(step, ExternStep):
        return f"extern {step.node.origin} -> {[v.name for v in step.node.outputs]}"
    return f"alias {step.value.name}"
