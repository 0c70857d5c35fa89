"""Dead code: nodes whose values nothing reads are dropped (a graph rewrite).

AOTAutograd's graphs are already free of dead FX nodes, but lowering leaves some: an op that ember
lowers may read only part of what its FX node was given. `flex_attention` without a BlockMask is
the common case: PyTorch builds a whole default mask in the graph (aranges, an `index_put`, a
stable sort for its transpose) and the forward kernel reads two of its eight tensors; every call
ran the other six's kernels and ATen calls.

Dropped: computed ops and views that no node, output or input mutation reads; and ATen externs of
the same kind whose op is functional (its schema writes nothing), not random (a dead `rand` would
still advance the generator in eager), has no effect torch knows of, and neither communicates (a
collective or its wait: dropped on one rank, the others hang) nor checks, and whose outputs have
sizes known before the call (an extern with data-dependent sizes binds symbols the host program may
read). An extern that returns
nothing is there for its effect (an assert), and stays, as does everything else.
"""

from __future__ import annotations

import sympy
import torch

from ember.ir.graph import COMPUTED_OPS, Graph, Node, Value


def _droppable(node: Node) -> bool:
    if node.op in (*COMPUTED_OPS, "view"):
        return True
    if node.op != "extern":
        return False
    target = node.attrs.get("target")
    if not isinstance(target, torch._ops.OpOverload) or not node.outputs:  # (a call for its check: an assert)
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags or _has_effect(target):
        return False
    return all(not isinstance(s, sympy.Expr) or s.is_number for v in node.outputs for s in v.shape)


# Namespaces whose ops communicate or record (a collective, its wait, a send: dropped on one rank,
# the others hang) and functional checks that return a token.
_EFFECT_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "_dtensor", "profiler")
_EFFECT_PREFIXES = ("_functional_assert", "_functional_sym_constrain_range", "sym_constrain_range", "_assert")


def _has_effect(target: torch._ops.OpOverload) -> bool:
    """Whether torch marks the op as having effects (FX keeps it in a dead graph), or it communicates,
    records or checks."""
    effectful = torch.fx.node._side_effectful_functions
    if target in effectful or target.overloadpacket in effectful:
        return True
    name = target._schema.name  # "namespace::op"
    namespace, _, op = name.partition("::")
    return namespace in _EFFECT_NAMESPACES or op.startswith(_EFFECT_PREFIXES)


def _read(x, into: set[int]) -> None:
    """Add the id of every Value in an output or argument tree."""
    if isinstance(x, Value):
        into.add(id(x))
    elif isinstance(x, (list, tuple)):
        for y in x:
            _read(y, into)
    elif isinstance(x, dict):
        for y in x.values():
            _read(y, into)


def eliminate_dead_nodes(graph: Graph) -> int:
    """Drop dead droppable nodes in place (one walk from the last node back, so a chain that only
    fed dead nodes goes too); returns how many were dropped."""
    live: set[int] = set()
    _read(graph.outputs, live)
    for value, _ in graph.mutations:
        live.add(id(value))
    kept: list[Node] = []
    for node in reversed(graph.nodes):
        if _droppable(node) and not any(id(v) in live for v in node.outputs):
            continue
        kept.append(node)
        _read(node.inputs, live)
        if node.op == "extern":
            _read(node.attrs.get("args"), live)
            _read(node.attrs.get("kwargs"), live)
    dropped = len(graph.nodes) - len(kept)
    graph.nodes = kept[::-1]
    return dropped


__all__ = ["eliminate_dead_nodes"]
