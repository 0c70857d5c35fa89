"""Skinny matrix products of one input, grouped into one launch.

A decoding step multiplies a few rows (one token per sequence) by each of a layer's weights: the query,
key and value projections read one hidden state, and so do the gate and up projections. Each such
product streams its weight once, and at a few megabytes a launch's fixed cost is most of its time:
on an H200 cuBLAS took about 6 us for each of the key and value projections of a 1B-parameter Llama
(0.5 us of bytes at the copy bandwidth), and three launches in a row cost three times one.

This pass finds `mm` / `addmm` calls that read the same input of at most `heuristics.skinny.max_rows`
rows, and replaces each set of at least `min_group` of them by one extern call, `SkinnyProducts`, whose
results are the products' own values: the backend (backends/skinny.py) gives it one Triton kernel whose
programs each compute a block of columns of one of the products (codegen/skinny_triton.py). The weights
stay where they are (no concatenated copy: under CUDA graphs they are static inputs, read in place).

A product joins the group of the first product of its input only where its other operands (the weight,
usually a transposed view of a graph input, and a bias) exist before that first product, or are views of
values that do: the grouped call then takes the first product's place, those views moved before it.
Products of other dtypes (float32 included), with alpha or beta, a bias that is not one value per column,
or symbolic sizes keep their own call, and so do all products under `gemm=template`.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from ember import config
from ember.ir.graph import Graph, Node, Value
from ember.ir.sizes import contiguous_strides
from ember.schedule.gemm import gemm_kind, per_column, product_operands
from ember.target import Target

aten = torch.ops.aten

# Half precision only: a float32 tile takes twice the shared memory (32 x 256 at 4 stages, 295 KB, past an
# H200's 232 KB), and tl.dot's float32 precision would follow a TF32 setting read when the kernel is rendered.
DTYPES = (torch.bfloat16, torch.float16)
# Products per launch, at most: the kernel's source holds a branch per product.
MAX_GROUP = 8
# Rows a product may have: the kernel computes one block of 16 rows (tl.dot's least), whatever the setting.
MAX_ROWS = 16


@dataclass(frozen=True)
class SkinnySpec:
    """A group's products: `rows` x `depth` input times a `depth` x `columns[i]` matrix each, with a
    bias per column where `biases[i]`."""

    rows: int
    depth: int
    columns: tuple[int, ...]
    biases: tuple[bool, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        widths = ", ".join(str(n) for n in self.columns)
        return f"{len(self.columns)} products of {self.rows}x{self.depth} by [{widths}] columns"


class SkinnyProducts:
    """The extern target of a group of skinny products until the backend builds its kernel
    (backends/skinny.py). Arguments at run time: the input, each product's matrix, then the biases of
    the products that have one. Results: the products, in order. Called as it is, it runs them
    through ATen: a graph keeps eager's answer where no kernel was built."""

    fresh_result = True
    row_major_results = True  # each product a fresh row-major tensor (codegen/host.py trusts the layout)

    def __init__(self, spec: SkinnySpec):
        self.spec = spec
        self.__name__ = "skinny_products"

    def __call__(self, a: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        matrices, biases = split_arguments(self.spec, rest)
        return tuple(torch.mm(a, b) if bias is None else torch.addmm(bias, a, b) for b, bias in zip(matrices, biases))

    def __repr__(self) -> str:
        return self.spec.describe()


def split_arguments(spec: SkinnySpec, rest: tuple) -> tuple[tuple, list]:
    """The call's matrices, and per product its bias or None."""
    count = len(spec.columns)
    matrices, given = rest[:count], iter(rest[count:])
    return matrices, [next(given) if has else None for has in spec.biases]


@dataclass
class _Product:
    node: Node
    a: Value
    b: Value
    bias: Value | None


def _product(node: Node, max_rows: int) -> _Product | None:
    """The call as a skinny product, or None where it is not one this pass takes."""
    kind = gemm_kind(node)
    parsed = product_operands(node, kind) if kind in ("mm", "addmm") else "not mm or addmm"
    if isinstance(parsed, str) or len(node.outputs) != 1:
        return None
    bias, a, b, alpha, beta = parsed
    if alpha != 1 or (bias is not None and beta != 1):
        return None
    out = node.out
    if not all(sympy.sympify(s).is_Integer for s in (*a.shape, *b.shape)):
        return None
    m, k = (int(s) for s in a.shape)
    if not 1 <= m <= min(max_rows, MAX_ROWS) or k < 1 or int(b.shape[1]) < 1 or out.dtype not in DTYPES:
        return None
    if out.stride is not None and tuple(out.stride) != tuple(contiguous_strides(out.shape)):
        return None
    if bias is not None and not per_column(bias, out):
        return None  # a bias per element, or one broadcast whole
    return _Product(node, a, b, bias)


def group_skinny_products(graph: Graph, target: Target) -> list[str]:
    """Replace each group of skinny products of one input by one SkinnyProducts call; returns a note
    per group."""
    h = target.heuristics.skinny
    if h.max_rows <= 0 or config.get("gemm") == "template":  # the user asked for the GEMM template
        return []
    by_input: dict[tuple, list[_Product]] = {}
    for node in graph.nodes:
        p = _product(node, h.max_rows)
        if p is not None:
            by_input.setdefault((p.a.id, p.a.dtype), []).append(p)
    need = max(2, h.min_group)
    notes = []
    for products in by_input.values():
        while len(products) >= need:  # each turn takes at least the first product off
            group, hoisted, products = _take_group(graph, products)
            if len(group) >= need:
                notes.append(_replace(graph, group, hoisted))
    return notes


def _take_group(graph: Graph, products: list[_Product]) -> tuple[list[_Product], list[Node], list[_Product]]:
    """The first product and the later ones whose operands it can take (at most MAX_GROUP), the view
    nodes to move before it, and the products left for another group."""
    place = {id(n): k for k, n in enumerate(graph.nodes)}
    first, later = products[0], products[1:]
    at = place[id(first.node)]
    group, hoisted, left = [first], {}, []
    for p in later:
        moves: dict[int, Node] = {}
        operands = [p.b] + ([p.bias] if p.bias is not None else [])
        if len(group) < MAX_GROUP and all(_available(v, at, place, moves) for v in operands):
            group.append(p)
            hoisted.update(moves)
        else:
            left.append(p)
    order = sorted(hoisted.values(), key=lambda n: place[id(n)])
    return group, order, left


def _available(v: Value, at: int, place: dict[int, int], moves: dict[int, Node]) -> bool:
    """Whether `v` exists before position `at`, or is a chain of views of values that do (whose nodes
    are added to `moves`)."""
    node = v.node
    if place[id(node)] < at or id(node) in moves:
        return True
    if node.op != "view":
        return False
    if not all(_available(x, at, place, moves) for x in node.value_inputs()):
        return False
    moves[id(node)] = node
    return True


def _replace(graph: Graph, group: list[_Product], hoisted: list[Node]) -> str:
    first = group[0]
    a = first.a
    spec = SkinnySpec(
        int(a.shape[0]),
        int(a.shape[1]),
        tuple(int(p.b.shape[1]) for p in group),
        tuple(p.bias is not None for p in group),
        a.dtype,
    )
    args = (a, *(p.b for p in group), *(p.bias for p in group if p.bias is not None))
    attrs = {
        "target": SkinnyProducts(spec),
        "args": args,
        "kwargs": {},
        "tuple_result": True,
        "output_positions": list(range(len(group))),
    }
    node = Node("extern", list(args), attrs, origin="skinny_products", fx_node=first.node.fx_node)
    for p in group:
        v = p.node.out
        v.node = node
        node.outputs.append(v)
    members = {id(p.node) for p in group}
    moved = {id(n) for n in hoisted}
    at = next(k for k, n in enumerate(graph.nodes) if n is first.node)
    before = [n for n in graph.nodes[:at] if id(n) not in moved]
    after = [n for n in graph.nodes[at:] if id(n) not in members and id(n) not in moved]
    graph.nodes = [*before, *hoisted, node, *after]
    outs = ", ".join(f"%{p.node.out.name}" for p in group)
    return f"{outs}: {spec.describe()} in one launch"


__all__ = ["MAX_ROWS", "SkinnyProducts", "SkinnySpec", "group_skinny_products", "split_arguments"]
