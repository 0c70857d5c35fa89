"""Matrix products of one input by frozen weights, as one product (CPU graphs under freezing).

A transformer layer multiplies one normalized hidden state by its query, key and value weights (and
Llama's MLP by its gate and up weights; an encoder-decoder's every cross-attention layer multiplies the
encoder's output by its key and value weights): several products of the same [rows, K] input by
[K, N_i] weights. Under freezing the weights are constants, so

    mm(x, w_1), ..., mm(x, w_n)    become    y = mm(x, cat([w_1, ..., w_n], dim=1))
                                             y[:, 0:N_1], ..., y[:, N_1+...:N]

(addmm's biases concatenated the same way, with zeros for the columns of an `mm` among them: Whisper's key
projection has no bias where its query and value have one). The freezing prologue concatenates the weights once; each
product's readers read its column slice of y where it lies (a view). One call of MKL's or oneDNN's
product over the wider weight takes less time than the calls it replaces: on the 2-core AMD EPYC (Zen 4),
a T5 encoder layer's three [128, 256] x [256, 256] products took 94-107 us each through either library, the
one [128, 256] x [256, 768] product 245-251 us through oneDNN's packed kernel
(docs/bench/cpu-grouped-products.txt). The grouped product then goes through prepack.py's measured choice
between oneDNN's packed kernel and ATen's like any other.

Left apart: products whose result an output may alias (its strides would change), those a reader or a
view's reader addresses in a way a column slice does not allow (a flattening `view`, `as_strided`), and
products of one input more than SPAN nodes apart (runs).
Memory: the concatenated weight, or its packed form, is a copy beside the model's own weights, as the
packed weights are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from ember.frontend.prepack import packable_linear

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default)
_LAYOUT_READERS = (aten.as_strided.default, aten._reshape_alias.default)
# Graph nodes between two products of one run, at most: a layer's query, key and value, or its gate and up, lie
# a few nodes apart; the next layer's products of the same input (an encoder-decoder's cross-attention keys and
# values over the encoder's output) lie a layer apart, and one result for all of them would be held from the
# first layer to the last (Whisper-large's 32 layers: about 490 MB, against 15 MB a layer).
SPAN = 24


def group_products(
    gm: fx.GraphModule, is_constant: Callable[[object], bool], fake_mode, hoist: Callable, aliased: set[fx.Node]
) -> int:
    """Rewrite (in place) each run of two or more packable products (prepack.packable_linear) of one input
    (`mm`, or `addmm` with a bias), each within `SPAN` nodes of the last, as one product and
    column slices of it; returns how many products were grouped. `hoist(graph, before, operands)` moves
    constant computations that come later in the graph before `before` (freezing._hoist); `aliased`: the
    nodes whose result a graph output may alias (freezing._output_aliases), left apart."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[tuple, list[list[fx.Node]]] = {}
    for node in gm.graph.nodes:
        if packable_linear(node, is_constant) and node not in aliased:
            x = node.args[0] if node.target is aten.mm.default else node.args[1]
            runs = groups.setdefault(_input_key(x), [[]])
            if runs[-1] and order[node] - order[runs[-1][-1]] > SPAN:
                runs.append([])  # far from the last: a result held until its readers there would be held long
            runs[-1].append(node)
    grouped = 0
    for products in (run for runs in groups.values() for run in runs):
        if len(products) > 1 and all(_slice_readable(p, fake_mode) for p in products):
            _group(gm.graph, products, fake_mode, hoist)
            grouped += len(products)
    if grouped:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return grouped


def _input_key(x: fx.Node) -> tuple[fx.Node, tuple]:
    """What a product's input is: the tensor it views and its shape. Each linear layer of a [B, T, C] input
    reads its own `view` of it as [B*T, C], so one input comes as several nodes."""
    shape = tuple(x.meta["val"].shape)
    while x.op == "call_function" and x.target in _VIEWS:
        x = x.args[0]
    return x, shape


def _slice_readable(product: fx.Node, fake_mode) -> bool:
    """Whether every reader of the product's result, and of each view of it, takes a column slice of a wider
    result in its place: each view is made again over such a slice (a flattening `view` cannot be), and no
    reader addresses the memory by strides of its own (`as_strided`)."""
    val = product.meta["val"]
    rows, n = val.shape
    with fake_mode:
        wider = torch.empty_strided((rows, n + 1), (n + 1, 1), dtype=val.dtype, device=val.device)[:, :n]
        return _views_hold(product, wider)


def _views_hold(node: fx.Node, val: torch.Tensor) -> bool:
    for user in node.users:
        if user.target in _LAYOUT_READERS:
            return False
        schema = getattr(user.target, "_schema", None)
        if schema is None or not any(r.alias_info for r in schema.returns) or user.args[:1] != (node,):
            continue  # computes from the values (or reads the result other than as its first operand)
        try:
            view = user.target(val, *user.args[1:], **user.kwargs)
        except (RuntimeError, ValueError):  # torch's view raises either, by where the sizes are checked
            return False
        if not isinstance(view, torch.Tensor) or not _views_hold(user, view):
            return False
    return True


def _weight_rows(graph: fx.Graph, w: fx.Node, fake_mode) -> fx.Node:
    """The [N, K] tensor a [K, N] weight operand transposes (a linear layer's own weight), or its transpose."""
    if w.target is aten.t.default or (w.target is aten.permute.default and list(w.args[1]) == [1, 0]):
        return w.args[0]
    node = graph.call_function(aten.permute.default, (w, [1, 0]))
    with fake_mode:
        node.meta["val"] = w.meta["val"].permute(1, 0)
    return node


def _bias(graph: fx.Graph, product: fx.Node, fake_mode) -> fx.Node:
    """The product's bias, or zeros of its width for an `mm` (a constant, which the freezing prologue makes once:
    adding them changes no value)."""
    if product.target is aten.addmm.default:
        return product.args[0]
    val = product.meta["val"]
    zeros = graph.call_function(aten.zeros.default, ([val.shape[1]],), {"dtype": val.dtype, "device": val.device})
    with fake_mode:
        zeros.meta["val"] = torch.zeros(val.shape[1], dtype=val.dtype, device=val.device)
    return zeros


def _group(graph: fx.Graph, products: list[fx.Node], fake_mode, hoist: Callable) -> None:
    first = products[0]  # graph order: the first product's place is before every reader of the others
    x = first.args[1] if first.target is aten.addmm.default else first.args[0]
    weights = [p.args[-1] for p in products]
    addmm = any(p.target is aten.addmm.default for p in products)
    given = [p.args[0] for p in products if p.target is aten.addmm.default]
    hoist(graph, first, weights + given)
    with graph.inserting_before(first):
        rows = graph.call_function(aten.cat.default, ([_weight_rows(graph, w, fake_mode) for w in weights], 0))
        weight = graph.call_function(aten.permute.default, (rows, [1, 0]))
        biases = [_bias(graph, p, fake_mode) for p in products] if addmm else []
        bias = graph.call_function(aten.cat.default, (biases, 0)) if addmm else None
        target = aten.addmm.default if addmm else aten.mm.default
        args = (bias, x, weight) if addmm else (x, weight)
        product = graph.call_function(target, args)
    with fake_mode:
        rows.meta["val"] = torch.cat([r.meta["val"] for r in rows.args[0]], 0)
        weight.meta["val"] = rows.meta["val"].permute(1, 0)
        if bias is not None:
            bias.meta["val"] = torch.cat([b.meta["val"] for b in biases], 0)
        product.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]))
    product.meta["stack_trace"] = first.meta.get("stack_trace")
    start = 0
    for p in products:
        width = p.meta["val"].shape[1]
        with graph.inserting_after(product):
            part = graph.call_function(aten.slice.Tensor, (product, 1, start, start + width))
        with fake_mode:
            part.meta["val"] = product.meta["val"][:, start : start + width]
        part.meta["stack_trace"] = p.meta.get("stack_trace")
        p.replace_all_uses_with(part)
        start += width
