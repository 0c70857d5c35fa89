"""A product's bias as ember's own add, where the library would spend a pass over the output on it.

ATen's CPU `addmm(bias, a, b)` copies the bias into every row of its output, then has the BLAS compute
`out = a @ b + out`: the output is written once more and read once more than `mm` writes it. A 1x1
convolution run as a product under freezing (frontend/prepack.py), a linear layer MKL runs (the measured
choice of backends/cpu_products.py), pays that on every call: 48 such copies took 0.37 ms of an
EfficientNet-B0 call on the 2-core CPU. Where the target says so (`heuristics.lower.product_bias_as_add`:
the C++ target's), such a call becomes `mm(a, b)` and a pointwise add of the bias, which the scheduler
fuses into the kernel that reads the product (its activation, its residual add) like any other.

Only float32 (eager's float32 addmm adds the bias in float32 too: the sum's rounding is one float32
rounding more, where a half-precision product would round twice to its own type), alpha and beta of 1,
and a bias of one value per column ([N] or [1, N]).
"""

from __future__ import annotations

import torch

from ember.ir.graph import Graph, Node, Value
from ember.schedule.gemm import gemm_kind, per_column, product_operands
from ember.target import Target

aten = torch.ops.aten


def _bias_of(node: Node) -> tuple[Value, Value, Value] | None:
    """(bias, a, b) of an addmm this pass rewrites, else None."""
    parsed = product_operands(node, "addmm") if gemm_kind(node) == "addmm" else None
    if parsed is None or isinstance(parsed, str) or len(node.outputs) != 1:
        return None
    bias, a, b, alpha, beta = parsed
    out = node.out
    if alpha != 1 or beta != 1 or out.dtype != torch.float32 or len(out.shape) != 2 or not per_column(bias, out):
        return None
    return bias, a, b


def products_bias_as_add(graph: Graph, target: Target) -> list[str]:
    """Rewrite each such addmm as mm and an add; returns a note per product."""
    if not target.heuristics.lower.product_bias_as_add:
        return []
    notes = []
    for node in list(graph.nodes):
        parsed = _bias_of(node)
        if parsed is None:
            continue
        bias, a, b = parsed
        out = node.out
        attrs = {**node.attrs, "target": aten.mm.default, "args": (a, b)}
        product = graph.add("extern", [a, b], attrs, [(out.shape, out.dtype, out.stride)], "mm")
        added = graph.add("pointwise", [product.out, bias], {"fn": "add"}, [(out.shape, out.dtype, None)], node.origin)
        product.fx_node = added.fx_node = node.fx_node
        graph.nodes[-2:] = []
        at = graph.nodes.index(node)
        graph.nodes[at : at + 1] = [product, added]
        graph.replace_uses(out, added.out)
        notes.append(f"%{out.name} -> mm %{product.out.name} + bias %{bias.name}")
    return notes


__all__ = ["products_bias_as_add"]
