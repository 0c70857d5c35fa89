"""Dead code: what nothing reads is dropped, and what may have an effect, or binds a size, stays."""

from __future__ import annotations

import importlib

import sympy
import torch

from ember.ir.dce import eliminate_dead_nodes
from ember.ir.graph import verify
from ember.ir.sizes import contiguous_strides
from tests.schedule.test_fusion import G


def _aten(b: G, target, *inputs, shape):
    node = b.g.add(
        "extern",
        list(inputs),
        {"target": target, "args": inputs, "kwargs": {}},
        [(shape, torch.float32, contiguous_strides(shape))],
    )
    return node.out


def test_dead_chain_of_kernels_and_functional_externs_goes():
    b = G()
    x = b.input(4, 8)
    dead = _aten(b, torch.ops.aten.sort.stable, b.pw("exp", b.view("permute", x, dims=(1, 0))), shape=x.shape)
    b.pw("neg", dead)
    live = b.pw("abs", x)
    b.g.outputs = [live]
    assert eliminate_dead_nodes(b.g) == 4  # neg, the sort, exp, the view
    verify(b.g)
    assert [n.op for n in b.g.nodes] == ["input", "pointwise"]


def test_mutating_random_unknown_and_data_dependent_externs_stay():
    b = G()
    x = b.input(4, 8)
    _aten(b, torch.ops.aten.add_.Tensor, x, x, shape=x.shape)  # writes its input
    _aten(b, torch.ops.aten.rand_like.default, x, shape=x.shape)  # advances the generator
    b.extern(x, shape=x.shape)  # not an ATen op: its effects are unknown
    b.g.add("extern", [x], {"target": torch.ops.aten._assert_async.default, "args": (x,), "kwargs": {}}, [])  # a check
    _aten(b, torch.ops.aten.nonzero.default, x, shape=(sympy.Symbol("u0"), sympy.Integer(2)))  # binds u0
    importlib.import_module("torch.distributed._functional_collectives")  # registers the collectives' ops
    functional = torch.ops._c10d_functional
    reduced = _aten(b, functional.all_reduce.default, x, shape=x.shape)  # every rank must take part
    _aten(b, functional.wait_tensor.default, reduced, shape=x.shape)
    _aten(b, torch.ops.aten._functional_assert_async.msg, x, shape=(sympy.Integer(0),))  # a check's token
    _aten(b, torch.ops.aten.sym_constrain_range_for_size.default, x, shape=(sympy.Integer(0),))
    b.g.outputs = [b.pw("abs", x)]
    assert eliminate_dead_nodes(b.g) == 0


def test_mutated_input_values_and_extern_arguments_are_reads():
    b = G()
    x = b.input(4, 8)
    new = b.pw("add", x, 1.0)
    arg = b.pw("exp", x)
    node = b.g.add(
        "extern",
        [],
        {"target": torch.ops.aten.clone.default, "args": ([arg],), "kwargs": {}},
        [(x.shape, torch.float32, contiguous_strides(x.shape))],
    )
    b.g.outputs = [node.out, new]
    b.g.mutations = [(x, 1)]
    assert eliminate_dead_nodes(b.g) == 0


def test_flex_attention_without_a_block_mask_builds_no_default_mask_per_call():
    """PyTorch builds a whole default BlockMask in the graph; the forward reads two of its tensors."""
    from torch.nn.attention.flex_attention import flex_attention

    from tests.helpers import explain_strict

    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    report = explain_strict(
        lambda q, k, v: flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + (i - j)), q, k, v
    )
    (graph,) = report.graphs
    # Its two tensors are constants (frontend/constant_fold.py): nothing computes them per call.
    computed = [e for e in graph.externs if not e.startswith("constant ")]
    assert computed == ["flex_attention"] and not graph.kernels, (graph.externs, graph.kernels)
