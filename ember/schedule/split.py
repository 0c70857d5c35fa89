"""Split long reductions with few outputs into two reductions (a graph rewrite before fusion).

A bias or LayerNorm-weight gradient sums 16384 rows into 768 outputs: as one reduction it
gives the machine 768 outputs' worth of parallel work and each program walks 16384 rows.
Rewritten as sum over [S, R/S] chunks then sum over S, the first stage has S times more
independent outputs (and fuses with whatever produced its input); the second is tiny.
"""

from __future__ import annotations

import sympy

from ember.ir import dtypes
from ember.ir.graph import Graph, Node
from ember.ir.sizes import product

# Split when the reduction has fewer outputs than this ...
MAX_OUTPUTS = 8192
# ... and at least this many elements per output; each chunk keeps at least MIN_CHUNK.
MIN_REDUCE = 4096
MIN_CHUNK = 256
# Aim for about this many independent partial results in the first stage.
TARGET_PARTIALS = 32768


def _split_factor(outputs: int, reduce: int) -> int:
    s = 1
    while reduce % (s * 2) == 0 and reduce // (s * 2) >= MIN_CHUNK and outputs * s * 2 <= TARGET_PARTIALS:
        s *= 2
    return s


def _normalizes(graph: Graph, node: Node) -> bool:
    """Whether the reduction's result is read back over the rows it reduced (softmax, layer_norm).

    Such a reduction fuses with its input and its epilogue into one kernel over the rows;
    splitting it would break that kernel in three.
    """
    (x,) = node.inputs
    frontier = [node.out]
    while frontier:
        v = frontier.pop()
        for user in graph.nodes:
            if v not in user.inputs:
                continue
            if user.op == "view":
                frontier.append(user.out)
            elif user.op in ("pointwise", "cast") and tuple(user.out.shape) == tuple(x.shape):
                return True
            elif user.op in ("pointwise", "cast"):
                frontier.append(user.out)  # e.g. rsqrt(var + eps) before the normalizing multiply
    return False


def split_reductions(graph: Graph) -> int:
    """Rewrite qualifying reductions in place; returns how many were split."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "reduce" or node.attrs["kind"] not in ("sum", "max", "min"):
            continue
        (x,) = node.inputs
        dims = tuple(node.attrs["dims"])
        if list(dims) != list(range(dims[0], dims[0] + len(dims))):
            continue  # only a contiguous run of dims can be regrouped by a reshape
        reduce = product(x.shape[d] for d in dims)
        outputs = product(s for k, s in enumerate(x.shape) if k not in dims)
        if not (reduce.is_Integer and outputs.is_Integer):
            continue
        if int(outputs) >= MAX_OUTPUTS or int(reduce) < MIN_REDUCE:
            continue
        s = _split_factor(int(outputs), int(reduce))
        if s < 2 or _normalizes(graph, node):
            continue
        _rewrite(graph, node, s)
        count += 1
    return count


def _rewrite(graph: Graph, node: Node, s: int) -> None:
    (x,) = node.inputs
    out = node.out
    dims = tuple(node.attrs["dims"])
    d0, d1 = dims[0], dims[-1]
    reduce = product(x.shape[d] for d in dims)
    chunked = x.shape[:d0] + (sympy.Integer(s), reduce / s) + x.shape[d1 + 1 :]
    at = graph.nodes.index(node)
    new_nodes: list[Node] = []

    def add(op, inputs, attrs, shape, dtype):
        n = graph.add(op, inputs, attrs, [(shape, dtype, None)], node.origin)
        graph.nodes.pop()  # graph.add appends; we insert in place below
        new_nodes.append(n)
        return n.out

    view = add("view", [x], {"kind": "reshape", "shape": chunked}, chunked, x.dtype)
    kind = node.attrs["kind"]
    partial_shape = chunked[: d0 + 1] + chunked[d0 + 2 :]
    # Partials keep the accumulation dtype: rounding them to bf16 would lose precision eager keeps.
    partial = add(
        "reduce",
        [view],
        {"kind": kind, "dims": (d0 + 1,), "keepdim": False},
        partial_shape,
        dtypes.compute_dtype(out.dtype),
    )
    final_shape = partial_shape[:d0] + partial_shape[d0 + 1 :]
    final = add("reduce", [partial], {"kind": kind, "dims": (d0,), "keepdim": False}, final_shape, out.dtype)
    if node.attrs["keepdim"]:
        final = add("view", [final], {"kind": "reshape", "shape": out.shape}, out.shape, out.dtype)
    graph.nodes[at : at + 1] = new_nodes
    graph.replace_uses(out, final)
