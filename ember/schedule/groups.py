"""Groups: one kernel per realized value, over its domain, before any fusion.

A reduction's group iterates over its input's shape with the reduced dims marked; any other
value's over its own shape. `group_kernel` builds a group's kernel, which fusion (to test a
merge) and ordering (to store only what others read) call again as groups change.
"""

from __future__ import annotations

from ember.ir.graph import Value
from ember.schedule.gemm import build_gemm_kernel
from ember.schedule.kernel import Domain, Kernel
from ember.schedule.kernel_builder import build_kernel
from ember.schedule.online import fold_online_softmax
from ember.schedule.state import Group, ScheduleState


def make_groups(state: ScheduleState) -> None:
    """A group for each realized value, in order (a value realized twice gets one), then its kernel."""
    for v in dict.fromkeys(state.realized):
        _new_group(state, v)
    for g in state.groups.values():
        g.kernel = group_kernel(state, g.domain, g.id, g.roots)


def _new_group(state: ScheduleState, v: Value) -> None:
    if v.node.op == "reduce":
        domain = Domain(v.node.inputs[0].shape, tuple(v.node.attrs["dims"]))
    elif v in state.indexed_stores:
        domain = Domain(state.indexed_stores[v].rows)  # the rows it writes
    else:
        domain = Domain(v.shape)
    gid = len(state.groups)
    state.groups[gid] = Group(gid, domain, [v], state.position[id(v.node)])
    state.owner[v] = gid
    if id(v.node) in state.gemm_plans:
        state.gemms.by_group[gid] = state.gemm_plans[id(v.node)]


def group_kernel(
    state: ScheduleState, domain: Domain, gid: int, roots: list[Value], stored: list[Value] | None = None
) -> Kernel:
    """The kernel of group `gid` computing `roots` over `domain` and storing `stored` (default:
    every root), as the target renders it: the GEMM template's for a product's group."""
    stored = list(roots) if stored is None else stored
    name = state.kernel_name(gid)
    if gid in state.gemms.by_group:
        return build_gemm_kernel(
            name, domain, gid, roots, stored, state.owner, state.gemms.by_group[gid], state.gathers
        )
    kernel = build_kernel(
        name,
        domain,
        gid,
        roots,
        stored,
        state.owner,
        state.target.column_partials,
        state.indexed_stores,
        state.gathers,
    )
    if state.target.online_softmax:
        fold_online_softmax(kernel)
    return kernel
