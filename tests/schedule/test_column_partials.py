"""Column sums accumulated by a row kernel (kernel.KColumnPartial, Inductor's "mix-order" reduction).

A LayerNorm's backward needs the input gradient (a reduction along each row) and the weight and
bias gradients (sums down the columns) of the same x and upstream gradient. On the Triton target
one kernel walks each chunk of rows once for all three; the C++ target keeps a column kernel of
its own. Compiled through Triton's CPU interpreter, checked against eager; the sizes are the
smallest the split of long column sums (schedule/split.py) applies to.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.target import SplitHeuristics
from tests.helpers import assert_close, assert_not_worse, ember_compile, forward_backward, fresh_inputs, reports, repro

F32 = 4
# The smallest sizes the split applies to: on the Triton target, whose row kernels accumulate column
# partials, a column sum splits from min_column_reduce rows; a column max, and a column sum on the C++
# target, from min_reduce rows.
N, C = SplitHeuristics().min_column_reduce, 64
N_LONG = SplitHeuristics().min_reduce


def _layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b) * 2.0


def _rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _inputs(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen) for s in shapes]


def _backward_report(fn, inputs, backend):
    with reports() as rep:
        forward_backward(ember_compile(fn, backend), [], inputs, grad_seed=1, train=True)
    (graph,) = [g for g in rep.graphs if g.kind == "backward"]
    return graph


def test_layer_norm_backward_reads_its_rows_once():
    x, w, b = fresh_inputs(_inputs((N, C), (C,), (C,)))
    graph = _backward_report(_layer_norm, [x, w, b], "triton")
    # One row kernel (input gradient, and the weight and bias gradients' partial sums per chunk of
    # 16 rows: N // 16 chunks), then one kernel summing the partials.
    chunks = N // 16
    row_kernel = 3 * N * C * F32 + 2 * N * F32 + C * F32 + 2 * chunks * C * F32  # x, dy, dx; mean, rstd; w
    final = 2 * chunks * C * F32 + 2 * C * F32
    assert len(graph.kernels) == 2, [k.name for k in graph.kernels]
    assert graph.bytes == row_kernel + final, (graph.bytes, row_kernel + final)
    # The C++ target reads x and dy again in a column kernel of its own.
    x, w, b = fresh_inputs(_inputs((N_LONG, C), (C,), (C,)))
    assert len(_backward_report(_layer_norm, [x, w, b], "cpp").kernels) == 3


# name, function, input shapes, train (forward and backward) or inference
CASES = [
    ("layer_norm", _layer_norm, [(N, C), (C,), (C,)], True),
    ("layer_norm_3d", _layer_norm, [(2, N // 2, C), (C,), (C,)], True),
    ("rmsnorm", _rmsnorm, [(N, C), (C,)], True),
    # A column max next to a row softmax over the same x. (Training, the backward's x == max
    # needs the column max before the row kernel: a cycle, refused.) Eight columns: Triton's
    # interpreter reduces a max element by element in Python, so each column costs.
    ("softmax_and_column_max", lambda x: (x.softmax(-1), x.amax(0)), [(N_LONG, 8)], False),
]


def _compare_with_eager(name, fn, shapes, train):
    """Compile fn for Triton, run it (forward and backward if train) and compare every result with
    eager's. The weight gradients are fp32 sums of N terms of magnitude ~2 in another order than
    eager's (chunks of 16 rows, then the chunks): differences of 1e-4 are rounding. Returns the
    compile reports and the repro line."""
    inputs = _inputs(*shapes)
    ref_outs, ref_grads = forward_backward(fn, [], fresh_inputs(inputs, grad=train), grad_seed=1, train=train)
    line = repro(case=name)
    with reports() as rep:
        compiled = ember_compile(fn, "triton")
        outs, grads = forward_backward(compiled, [], fresh_inputs(inputs, grad=train), grad_seed=1, train=train)
    for k, (a, e) in enumerate(zip(outs + grads, ref_outs + ref_grads)):
        assert_close(a, e, rtol=1e-4, atol=1e-3, what=f"{name} result {k}", line=line)
    return rep, line


@pytest.mark.parametrize("name,fn,shapes,train", CASES, ids=[c[0] for c in CASES])
def test_matches_eager_fp32(name, fn, shapes, train):
    rep, line = _compare_with_eager(name, fn, shapes, train)
    assert any("colacc" in k.source for g in rep.graphs for k in g.kernels), f"no row kernel sums columns\n{line}"


def test_layer_norm_bf16_against_fp32_reference():
    inputs = _inputs((N, C), (C,), (C,), seed=3)
    ref_outs, ref_grads = forward_backward(_layer_norm, [], fresh_inputs(inputs), grad_seed=1, train=True)
    eager = forward_backward(_layer_norm, [], fresh_inputs(inputs, torch.bfloat16), grad_seed=1, train=True)
    compiled_fn = ember_compile(_layer_norm, "triton")
    compiled = forward_backward(compiled_fn, [], fresh_inputs(inputs, torch.bfloat16), grad_seed=1, train=True)
    line = repro(case="layer_norm bf16")
    pairs = zip(compiled[0] + compiled[1], eager[0] + eager[1], ref_outs + ref_grads)
    for k, (c, e, r) in enumerate(pairs):
        assert_not_worse(c, e, r, what=f"result {k}", line=line)


def _sum_beside_rmsnorm(x, a, b):
    g = a @ b  # a product read by nothing but the column sum
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    return y, (x * g).sum(0)


def test_no_output_written_over_a_buffer_only_the_column_sum_reads():
    # The column sum's terms are computed after the row's stores: y written in place of g (dead
    # after this kernel) once made the sum read y. Off by ~5e3 before the fix.
    x, a, b = _inputs((N, C), (N, 16), (16, C))
    line = repro(case="sum beside rmsnorm")
    with reports() as rep:
        got = ember_compile(_sum_beside_rmsnorm, "triton")(x, a, b)
    assert any("colacc" in k.source for g in rep.graphs for k in g.kernels), f"no row kernel sums columns\n{line}"
    for k, (a_, e) in enumerate(zip(got, _sum_beside_rmsnorm(x, a, b))):
        assert_close(a_, e, rtol=1e-4, atol=1e-3, what=f"result {k}", line=line)


# Forms the row kernel refuses (a chunk that is not a power of two: 5000 rows split in 8 chunks of
# 625; rows of one element, which leave no row loop): each once crashed the compile.
REFUSED = [
    ("layer_norm_5000_rows", _layer_norm, [(5000, C), (C,), (C,)], True),
    ("softmax_and_column_sum_of_width_1", lambda x: (x.softmax(-1), x.sum(0)), [(N_LONG, 1)], False),
]


@pytest.mark.parametrize("name,fn,shapes,train", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_forms_match_eager(name, fn, shapes, train):
    _compare_with_eager(name, fn, shapes, train)
