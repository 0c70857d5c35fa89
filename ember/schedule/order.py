"""Order: the schedule's steps, each after the steps computing what it reads.

Each group's kernel is built a last time, storing only the values another step reads (the
rest stay in registers). Kernels and extern calls are ordered topologically, ties broken by
their place in the graph; an alias follows the step that computes its base, and aliases of
graph inputs come first. Under the setting `overlap_collectives`, a functional collective starts
as soon as its inputs allow and is waited on just before its result is first read, the compute
independent of it running in between (collectives.py).
"""

from __future__ import annotations

import itertools

from ember import config
from ember.ir.graph import Value
from ember.schedule import collectives
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
    roles = [collectives.role(step) for _, step, _ in items]
    waits: set[int] = set()
    overlap = config.get("overlap_collectives") and any(roles)
    if overlap:
        starts = sorted((k for k, r in enumerate(roles) if r == "start"), key=lambda k: items[k][0])
        for before, after in itertools.pairwise(starts):
            deps[after].add(before)  # every rank issues its collectives in the program's order
        waits = {k for k, r in enumerate(roles) if r == "wait"}
    done: set[int] = set()
    order: list[Step] = []

    def emit(k: int) -> None:
        done.add(k)
        order.append(items[k][1])
        outs = set(step_outputs(items[k][1]))
        order.extend(a for a in state.aliases.values() if a.base in outs)

    while len(done) < len(items):
        # A wait is taken only for a step that reads it (or when nothing else is left): it counts
        # as available once its collective has started.
        open_waits = {w for w in waits - done if deps[w] <= done}
        available = done | open_waits if open_waits else done  # one set per step taken, not per candidate
        ready = [k for k in range(len(items)) if k not in done and k not in waits and deps[k] <= available]
        if not ready:
            ready = sorted(open_waits)
        if not ready:
            stuck = [
                (_describe(items[k][1]), sorted(_describe(items[d][1]) for d in deps[k] - done))
                for k in range(len(items))
                if k not in done
            ]
            raise RuntimeError(f"schedule has a cycle among {stuck}")
        # Starts first, then steps that wait on no collective, then those that do; graph order within.
        k = min(ready, key=lambda k: (overlap and roles[k] != "start", bool(deps[k] & open_waits), items[k][0]))
        for w in sorted(deps[k] & open_waits, key=lambda w: items[w][0]):
            emit(w)
        emit(k)
    order[:0] = [a for a in state.aliases.values() if a.base.node.op == "input"]
    state.steps = order


def _steps_and_needs(state: ScheduleState) -> list[tuple[int, Step, set]]:
    """(position, step, the values it needs) for each kernel, with its final kernel, and each extern call."""
    items: list[tuple[int, Step, set]] = []
    aliases = state.aliases
    for g in state.groups.values():
        stored = [v for v in g.roots if state.needed_outside(v, {g.id})]
        if len(stored) < len(g.roots):
            # Built (by grouping or a merge) storing every root: rebuilt storing only what others read.
            # A kernel that stores them all is the one it has (what its group reads and computes has not
            # changed since: a later merge elsewhere only moves who owns what it loads).
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
