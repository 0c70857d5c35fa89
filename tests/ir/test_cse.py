"""Common subexpressions: duplicate pure nodes merge, chains through views merge, and what must
stay apart (graph outputs, externs, constants that only compare equal) does."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.ir.cse import eliminate_common_subexpressions
from ember.ir.graph import verify
from tests.helpers import assert_close, explain_strict, repro
from tests.schedule.test_fusion import G


def _consumers(b: G, *values):
    """An extern reading each value: keeps them alive without making them outputs."""
    return b.extern(*values, shape=values[0].shape)


def test_duplicate_chain_through_views_merges_once():
    b = G()
    x = b.input(4, 8)
    m1 = b.pw("exp", b.view("permute", x, dims=(1, 0)))
    m2 = b.pw("exp", b.view("permute", x, dims=(1, 0)))
    b.g.outputs = [_consumers(b, m1, m2)]
    assert eliminate_common_subexpressions(b.g) == 2  # the second view, then the second exp
    verify(b.g)
    (ext,) = [n for n in b.g.nodes if n.op == "extern"]
    assert ext.inputs == [m1, m1]


def test_different_attributes_or_constants_stay_apart():
    b = G()
    x = b.input(4, 8)
    a = b.pw("add", x, 0.0)
    c = b.pw("add", x, -0.0)  # equal as floats, not as values (1 / x)
    d = b.pw("add", x, 0)  # an int constant: a different promotion
    s1, s2 = b.reduce("sum", x, (0,)), b.reduce("sum", x, (1,))
    b.g.outputs = [_consumers(b, a, c, d), _consumers(b, s1, s2)]
    assert eliminate_common_subexpressions(b.g) == 0


def test_returned_values_stay_two_tensors():
    # The caller may write one output in place; the other must not change with it.
    b = G()
    x = b.input(4, 8)
    y1, y2 = b.pw("exp", x), b.pw("exp", x)
    b.g.outputs = [y1, y2]
    assert eliminate_common_subexpressions(b.g) == 0


def test_values_returned_through_views_stay_apart():
    # a.t() and b.t() returned: merging a and b would make the two outputs one buffer.
    b = G()
    x = b.input(4, 8)
    y1, y2 = b.pw("exp", x), b.pw("exp", x)
    b.g.outputs = [b.view("permute", y1, dims=(1, 0)), b.view("permute", y2, dims=(1, 0))]
    assert eliminate_common_subexpressions(b.g) == 0


def test_compiled_outputs_through_views_are_two_tensors():
    def f(x):
        return (x * 2).t(), (x * 2).t()

    x = torch.randn(4, 8)
    a, c = torch.compile(f, backend="ember", options={"strict": True})(x)
    assert a.data_ptr() != c.data_ptr()
    a.add_(100.0)  # the caller writes one output; the other must not change
    assert_close(c, (x * 2).t(), rtol=0, atol=0, what="second output", line=repro())


def test_externs_are_not_merged():
    b = G()
    x = b.input(4, 4)
    b.g.outputs = [b.pw("add", b.extern(x, shape=x.shape), b.extern(x, shape=x.shape))]
    assert eliminate_common_subexpressions(b.g) == 0


def _three_attentions(q, k, v, mask):
    out = q
    for _ in range(3):  # each layer expands the shared mask itself, as transformers' models do
        out = F.scaled_dot_product_attention(out, k, v, attn_mask=mask.expand(2, 1, 64, 64))
    return out


def test_shared_attention_mask_is_converted_once():
    # SDPA's decomposition converts a boolean mask to an additive float mask at each call (BERT:
    # 12 layers, 12 identical [32, 1, 512, 512] masks written by one kernel at the first layer on
    # the GPU). Merged, one kernel writes one mask and the planned peak is eager's.
    q, k, v = (torch.randn(2, 4, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.arange(64)[:, None] >= torch.arange(64)[None, :]
    report = explain_strict(_three_attentions, q, k, v, mask, backend="triton")
    (graph,) = report.graphs
    (kernel,) = graph.kernels
    one_mask = 2 * 64 * 64 * 4  # fp32
    assert kernel.bytes < 2 * one_mask, (kernel.bytes, one_mask)
    assert graph.peak_bytes <= graph.eager_peak_bytes, graph.memory
    compiled = torch.compile(_three_attentions, backend="ember", options={"strict": True, "backend": "triton"})
    expected = _three_attentions(q, k, v, mask)
    assert_close(compiled(q, k, v, mask), expected, rtol=1e-5, atol=1e-5, what="attention", line=repro())
