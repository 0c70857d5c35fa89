"""Peak memory: undo the sibling merges that raise the planned peak above eager's.

A sibling merge runs the later sibling's work at the earlier one's place, so the values it
computes are held longer. When the planned peak (memory.py) exceeds eager's by more than a
little, the values that sibling merges moved earlier and that are live at the peak are refused
sibling merges, the largest first, until they cover the excess, and the graph is scheduled
again, a few times at most. Only a schedule with a lower peak is kept. If the peak is still
over, a schedule without any sibling merge is taken where its peak is lower.
(ResNet-50's backward: one such merge raised the peak 103 MB over eager's, and refusing every
sibling merge split each batch norm's two gradient sums into two passes over the gradient.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ember.ir.graph import Value
from ember.schedule.cost import size_hint
from ember.schedule.fusion import FusionPolicy
from ember.schedule.memory import MemoryPlan, nbytes
from ember.schedule.state import Group, ScheduleState
from ember.schedule.steps import FusionDecision

# Scratch a schedule may hold beyond eager's peak without counting as raising it: split
# reductions keep small partial results (eager has none), a few KB per reduction.
PEAK_SLACK_BYTES = 1 << 20
# Reschedules refusing the sibling merges live at the peak, before refusing them all.
PEAK_RETRIES = 3

Reschedule = Callable[[FusionPolicy], ScheduleState]  # the passes, run again with other fusion rules


def keep_under_eager_peak(state: ScheduleState, reschedule: Reschedule, policy: FusionPolicy) -> ScheduleState:
    """`state`, or a schedule of the same graph whose sibling merges raise its peak less."""
    eager = state.memory.eager_peak_bytes
    limit = None if eager is None else eager * 1.01 + PEAK_SLACK_BYTES
    state = _refuse_siblings_live_at_peak(state, reschedule, policy, limit)
    if not _over(state.memory, limit):
        return state
    plan = state.memory
    alone = reschedule(dataclasses.replace(policy, siblings=False))
    if alone.memory.peak_bytes >= plan.peak_bytes:
        return state
    alone.decisions.append(
        FusionDecision(
            "*", "*", False,
            f"sibling merges refused: they would raise peak memory to {plan.peak_bytes / 1e6:.3g} MB "
            f"(eager {eager / 1e6:.3g} MB; without them {alone.memory.peak_bytes / 1e6:.3g} MB)",
        )
    )  # fmt: skip
    return alone


def _over(plan: MemoryPlan, limit: float | None) -> bool:
    return plan.peak_bytes is not None and limit is not None and plan.peak_bytes > limit


def _refuse_siblings_live_at_peak(
    state: ScheduleState, reschedule: Reschedule, policy: FusionPolicy, limit: float | None
) -> ScheduleState:
    refused: set[Value] = set()
    notes: list[FusionDecision] = []
    for _ in range(PEAK_RETRIES):
        if not _over(state.memory, limit):
            break
        held = _held_at_peak(state, refused)
        if not held:
            break
        excess, chosen = state.memory.peak_bytes - limit, []
        for v in sorted(held, key=lambda v: (-_bytes(v), v.id)):
            chosen.append(v)
            excess -= _bytes(v)
            if excess <= 0:
                break
        was = state.memory.peak_bytes
        names = ", ".join(dict.fromkeys(state.kernel_name(held[v].id) for v in chosen))
        refused |= set(chosen)
        retry = reschedule(dataclasses.replace(policy, no_siblings=frozenset(refused)))
        if retry.memory.peak_bytes >= was:
            continue  # no lower: keep the best schedule so far; the next retry refuses other values
        state = retry
        notes.append(
            FusionDecision(
                "*", names, False,
                f"sibling merges refused: live at the peak, they raised it to {was / 1e6:.3g} MB "
                f"(eager {state.memory.eager_peak_bytes / 1e6:.3g} MB; "
                f"without them {state.memory.peak_bytes / 1e6:.3g} MB)",
            )
        )  # fmt: skip
    state.decisions.extend(notes)
    return state


def _held_at_peak(state: ScheduleState, refused: set[Value]) -> dict[Value, Group]:
    """Values live at the peak that a sibling merge computes before their place in the graph (not
    yet refused), each with the group computing it."""
    live = state.memory.peak_live
    return {
        v: g
        for gid, g in state.groups.items()
        if gid in state.sibling_merged
        for v in g.roots
        if v in live and v not in refused and state.position.get(id(v.node), g.first) > g.first
    }


def _bytes(v: Value) -> int:
    return size_hint(nbytes(v))
