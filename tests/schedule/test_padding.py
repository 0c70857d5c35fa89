"""Products with rows that are not 16-byte aligned get padded layouts (schedule/padding.py).

On the GPU this is what lets cuBLAS use its aligned kernels for a 50257-wide vocabulary head.
Here the same layouts are exercised on the CPU (the target's `pad` heuristics turned on): the
product is written into padded rows (an aligned product over the first N8 columns, a thin one
over the rest) and kept as a view of them, kernels downstream index them, and matrices ember computes for a product (the
logits' gradient) are laid out padded from the start.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from ember import config
from ember.schedule import padding
from tests.helpers import assert_close, explain_strict, repro

VOCAB, D, ROWS = 1001, 64, 96  # 1001 bf16 columns: rows of 2002 bytes, not a multiple of 16


@pytest.fixture
def pad_on_cpu():
    # addmm stays whole, as the GPU target has it (the C++ target runs a float32 bias as its own add).
    with config.override(heuristics="pad.products=1,pad.min_elements=1,lower.product_bias_as_add=0"):
        yield


def _head_loss(x, w, target):
    logits = x @ w.t()
    return F.cross_entropy(logits.float(), target), logits


def test_vocabulary_head_padded_inference(pad_on_cpu):
    x, w = torch.randn(ROWS, D, dtype=torch.bfloat16), torch.randn(VOCAB, D, dtype=torch.bfloat16)
    target = torch.randint(0, VOCAB, (ROWS,))
    with torch.no_grad():
        report = explain_strict(_head_loss, x, w, target)
        loss, logits = torch.compile(_head_loss, backend="ember")(x, w, target)
        want_loss, want_logits = _head_loss(x, w, target)
    line = repro(case="head inference")
    assert_close(logits, want_logits, rtol=1e-2, atol=1e-2, what="logits", line=line)
    assert_close(loss, want_loss, rtol=1e-3, atol=1e-3, what="loss", line=line)
    assert logits.stride() == (1008, 1), line  # padded to 16 bytes, same values
    host = report.graphs[0].host_source
    # Written into padded rows by the product decided at compile time, whose layout needs no check.
    assert re.search(r"= \(?mm_default_aligned_N_padded_1001_1008_\d+\(", host) and "_fix_layout" not in host, host


def test_the_cpu_target_pads_nothing():
    x, w = torch.randn(ROWS, D, dtype=torch.bfloat16), torch.randn(VOCAB, D, dtype=torch.bfloat16)
    with torch.no_grad():
        report = explain_strict(_head_loss, x, w, torch.randint(0, VOCAB, (ROWS,)))
    host = report.graphs[0].host_source
    assert re.search(r"= mm_\d+\(a\d+, v\d+\)\n", host) and "1008" not in host and "aligned" not in host, host


def test_vocabulary_head_padded_training(pad_on_cpu):
    x = torch.randn(ROWS, D, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(VOCAB, D, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, VOCAB, (ROWS,))
    xr, wr = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    loss, _ = torch.compile(_head_loss, backend="ember")(x, w, target)
    want, _ = _head_loss(xr, wr, target)
    loss.backward()
    want.backward()
    line = repro(case="head training")
    assert_close(loss, want, rtol=1e-3, atol=1e-3, what="loss", line=line)
    assert_close(x.grad, xr.grad, rtol=2e-2, atol=2e-2, what="x grad", line=line)
    assert_close(w.grad, wr.grad, rtol=2e-2, atol=2e-2, what="w grad", line=line)
    assert x.grad.stride() == xr.grad.stride() and w.grad.stride() == wr.grad.stride(), line
    report = explain_strict(_head_loss, x, w, target)
    backward = [g for g in report.graphs if g.kind == "backward"]
    assert backward and "(1008, 1)" in backward[0].host_source, backward[0].host_source  # the logits' gradient


def test_linear_with_bias_padded(pad_on_cpu):
    x, w, b = torch.randn(ROWS, D), torch.randn(VOCAB, D), torch.randn(VOCAB)
    fn = lambda x, w, b: torch.relu(F.linear(x, w, b))  # addmm, then a kernel over it
    with torch.no_grad():
        got = torch.compile(fn, backend="ember")(x, w, b)
    assert_close(got, fn(x, w, b), rtol=1e-5, atol=1e-4, what="linear", line=repro(case="addmm"))


@pytest.mark.parametrize(
    "m,k,n,a_transposed",
    [
        (64, 1001, 96, False),
        (1001, 64, 96, True),
        (64, 96, 1001, False),
        (1001, 1001, 1001, True),
        (64, 1001, 96, None),
    ],
    ids=["k_split", "m_split", "n_padded", "all", "broadcast_a"],
)
def test_aligned_product_pieces_equal_the_product(m, k, n, a_transposed):
    """Each way AlignedProduct cuts a product (K split, M split for a column-major A, N padded)
    gives the product, for mm and addmm."""
    aten = torch.ops.aten
    if a_transposed is None:  # a broadcast gradient: zero strides, copied into padded rows first
        a = torch.tensor(0.5, dtype=torch.float64).expand(m, k)
    else:
        a = torch.randn(k, m, dtype=torch.float64).t() if a_transposed else torch.randn(m, k, dtype=torch.float64)
    b, bias = torch.randn(k, n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    for op, args in ((aten.mm.default, (a, b)), (aten.addmm.default, (bias, a, b))):
        for product in (padding.AlignedProduct(op), padding.AlignedProduct(op, n, -(-n // 8) * 8)):
            layouts = [(tuple(t.shape), t.stride(), t.dtype) for t in args]
            decided = product.specialize(layouts)  # the cuts decided from the layouts, as the host program does
            for fn in (product, decided):
                got = fn(*args)
                line = repro(m=m, k=k, n=n, fn=product.__name__)
                assert_close(got, op(*args), rtol=1e-12, atol=1e-10, what=type(fn).__name__, line=line)


def test_aligned_products_are_decided_when_the_program_is_written(pad_on_cpu):
    """With static layouts an aligned product is the plain ATen call (torch.addmm / torch.mm), not a
    wrapper that checks strides per call; only an operand whose layout the program does not set
    itself (an input) keeps one stride check, whose other branch is the undecided product."""
    w1, b1, w2 = torch.randn(128, D), torch.randn(128), torch.randn(64, 128)
    fn = lambda x: torch.relu(F.linear(x, w1, b1)) @ w2.t()  # addmm on the input, mm on a kernel's result
    x = torch.randn(ROWS, D)
    with torch.no_grad():
        report = explain_strict(fn, x)
        got = torch.compile(fn, backend="ember")(x)
    host = report.graphs[0].host_source
    assert re.search(
        r"\(addmm_\d+\((\w+), (\w+), (\w+)\) if \2\.stride\(\) == \(64, 1\) else addmm_default_aligned_", host
    ), host
    assert re.search(r"= mm_\d+\(buf\d+, v\d+\)\n", host), host  # its operands' layouts are the program's own
    assert "_fix_layout" not in host, host  # products return their meta's layout by contract
    assert_close(got, fn(x), rtol=1e-4, atol=1e-4, what="linear, relu, mm", line=repro(case="decided products"))


def test_a_decided_product_with_another_layout_takes_the_checking_path(pad_on_cpu):
    """The stride check's other branch: the host program called with an input in another layout than
    its meta's still computes the product (AlignedProduct looks at the run-time strides)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.pipeline import compile_graph

    fn = lambda x, w, b: (torch.relu(F.linear(x, w, b)),)
    x, w, b = torch.randn(ROWS, D), torch.randn(128, D), torch.randn(128)
    with torch.no_grad(), config.override(strict=True):
        compiled = compile_graph(make_fx(fn)(x, w, b), [x, w, b], "inference")
        assert ".stride() == (64, 1) else addmm_default_aligned_" in compiled.report.host_source
        column_major = x.t().contiguous().t()
        (got,) = compiled([column_major, w, b])
    assert_close(got, fn(x, w, b)[0], rtol=1e-4, atol=1e-4, what="column-major x", line=repro(case="check fails"))


def test_an_epilogue_writes_over_an_aligned_product(pad_on_cpu):
    # AlignedProduct returns memory it allocated: the GELU after a Linear writes over the product,
    # as after a plain addmm. Taken for a possible view, the product was never reused: on the GPU
    # every GELU took a second buffer (hf_bert inference planned 411 MB, eager's peak 277).
    m = torch.nn.Sequential(torch.nn.Linear(D, 128), torch.nn.GELU())
    x = torch.randn(ROWS, D)
    with torch.no_grad():
        report = explain_strict(m, x)
        got = torch.compile(m, backend="ember")(x)
    assert re.search(r"\b1 in place", report.graphs[0].memory), report.graphs[0].memory
    assert_close(got, m(x), rtol=1e-5, atol=1e-5, what="linear + gelu", line=repro(case="in place"))


def test_a_cpu_product_never_reads_an_operands_row_padding():
    """A padded buffer's padding is never written: it may hold NaN bits. The CPU's bf16 GEMM reads
    a row-padded operand's padding, so the product gets dense operands there; the result is the
    product of the logical matrices, with no NaN."""
    storage = torch.full((96, 1008), float("nan"), dtype=torch.bfloat16)
    a = storage[:, :1001]  # rows 1008 apart, the padding NaN
    a.copy_(torch.randn(96, 1001))
    b = torch.randn(1001, 64, dtype=torch.bfloat16)
    product = padding.AlignedProduct(torch.ops.aten.mm.default, dense_operands=True)
    fixed = product.specialize([((96, 1001), (1008, 1), torch.bfloat16), ((1001, 64), (64, 1), torch.bfloat16)])
    aligned_k = product.specialize([((96, 1000), (1008, 1), torch.bfloat16), ((1000, 64), (64, 1), torch.bfloat16)])
    assert aligned_k is not torch.ops.aten.mm.default  # no cut needed, but a padded operand: not the plain call
    expected = (a.float() @ b.float()).to(torch.bfloat16)
    assert not torch.isnan(aligned_k(a[:, :1000], b[:1000])).any()
    for run in (product, fixed):
        got = run(a, b)
        assert not torch.isnan(got).any()
        assert_close(got, expected, rtol=2e-2, atol=2e-1, what="product", line=repro(case="padded operand"))
