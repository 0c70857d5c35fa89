"""C++ looped reductions: what each pass over a row reads and computes, checked against eager.

- A row value that costs more to compute again than to read back (layer norm's rounded x + r:
  two bf16 loads, an add and a rounding) is kept in the per-thread row array by the pass that first
  computes it; the mean, variance and output passes then read x and r once.
- A one-hot sum (the importer's form of gather: cross_entropy's target logit) reads the one element
  it selects instead of comparing the index at every element of the row.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from ember.tools.workloads import LayerNormGelu
from tests.helpers import ember_compile, explain_strict, repro


def _odd_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, cols) * 3
    x[1, 7] = float("nan")
    x[2, :] = float("-inf")
    x[3, 5] = float("inf")
    x[4, 0] = -0.0
    return x.to(dtype)


def _row_loads(source: str) -> list[str]:
    """The loads of full rows (index varies with the row l0 and the position l1)."""
    return re.findall(r"= (in_\w+)\[\(\(\d+ \* l0\) \+ l1\)\];", source)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [300, 257])
def test_layer_norm_residual_reads_its_inputs_once(dtype, cols):
    module = LayerNormGelu(cols).to(dtype)
    with torch.no_grad():
        module.norm.weight.normal_()
        module.norm.bias.normal_()
    x, r = _odd_rows(6, cols, dtype), torch.randn(6, cols).to(dtype)
    line = repro(dtype=dtype, cols=cols)
    with torch.no_grad():
        got, want = ember_compile(module, "cpp")(x, r), module(x, r)
        (kernel,) = explain_strict(module, x, r).kernels
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{m}\n{line}")
    if dtype != torch.bfloat16:
        return  # fp32 x + r is two loads and an add: under ROW_CACHE_MIN_WORK, computed again
    # x and r once each (the pass computing the mean), not again for the variance and the output.
    assert sorted(_row_loads(kernel.source)) == sorted(set(_row_loads(kernel.source))), kernel.source
    assert len(_row_loads(kernel.source)) == 2 and "rowcache" in kernel.source, kernel.source


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1001, 64])
def test_cross_entropy_reads_the_target_logit(dtype, vocab):
    logits = _odd_rows(7, vocab, dtype)
    targets = torch.tensor([0, 7, 3, 5, 0, vocab - 1, -100])  # row 1 picks its NaN, row 3 its inf
    fn = lambda x, t: F.cross_entropy(x, t, reduction="none")
    line = repro(dtype=dtype, vocab=vocab)
    got, want = ember_compile(fn, "cpp")(logits, targets), fn(logits, targets)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{m}\n{line}")
    source = "\n".join(k.source for k in explain_strict(fn, logits, targets).kernels)
    assert not re.search(r"\(l1 == |== l1\)|= l1;", source), source  # no compare per element
    # The max pass, the sum-exp pass, and the target logit read at its index.
    assert len(_row_loads(source)) == 3 and source.count("int64_t l1 = static_cast<int64_t>(") == 1, source


def test_gather_keeps_the_sign_of_zero():
    """The selected element itself, as eager's gather: -0.0 stays -0.0 (0 + -0.0 would be +0.0)."""
    x = torch.tensor([[1.0, -0.0, 2.0], [-0.0, 3.0, 4.0]])
    index = torch.tensor([[1], [0]])
    fn = lambda x, i: x.gather(1, i)
    got = ember_compile(fn, "cpp")(x, index)
    assert torch.equal(got, fn(x, index)) and bool(torch.signbit(got).all()), got
