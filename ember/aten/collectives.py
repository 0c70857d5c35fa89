"""Functional collectives in an ATen graph: which calls start communication and which wait on it.

torch.distributed's functional collectives (`torch.distributed._functional_collectives`, and what
Dynamo makes of `dist.all_reduce` and friends in a traced program) reach ember as pairs of ATen
calls: a start (`_c10d_functional.all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`,
their coalesced forms, `all_to_all_single`, `broadcast`) that launches the communication and
returns a tensor still being written, and `_c10d_functional.wait_tensor` on it. Both run as
externs (ATen calls); the importer marks them (`collective_role`) so the scheduler can start
each early and wait on it late (schedule/collectives.py). The in-place forms (`all_reduce_`)
mutate their input and decline the graph like every mutating op.
"""

from __future__ import annotations

_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
_STARTS = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
        "broadcast",
    }
)


def collective_role(target) -> str | None:
    """The op's part in a collective: "start", "wait", or None for an ATen op that is neither."""
    if getattr(target, "namespace", None) not in _NAMESPACES:
        return None
    name = target.overloadpacket.__name__
    if name == "wait_tensor":
        return "wait"
    return "start" if name in _STARTS else None
