"""SDPA's math path: `_safe_softmax` (a row that is all -inf gives zeros, not nan) as one kernel.

PyTorch's math attention (what AOTAutograd traces when no fused kernel is chosen, e.g. HF BERT's
masked SDPA) calls `_safe_softmax`, which decomposes into softmax, `all(x == -inf)` and
`full_like`. As an extern it ran four ATen kernels per layer on the H100 (10 ms of hf_bert).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import BACKENDS, assert_close, ember_compile, explain_strict, repro


def _masked_probs(x, mask):
    return torch.ops.aten._safe_softmax((x + mask).float(), -1).to(x.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_safe_softmax_is_one_kernel_and_zero_on_masked_rows(backend):
    x = torch.randn(2, 3, 8, 16, dtype=torch.bfloat16)
    mask = torch.zeros(2, 1, 1, 16, dtype=torch.bfloat16)
    mask[0, ..., 5:] = float("-inf")
    mask[1] = float("-inf")  # whole rows masked: eager gives 0, plain softmax nan
    got = ember_compile(_masked_probs, backend)(x, mask)
    want = _masked_probs(x, mask)
    line = repro(backend=backend)
    assert_close(got, want, rtol=2e-2, atol=1e-2, what="probs", line=line)
    assert torch.equal(got[1], torch.zeros_like(got[1])), line
    report = explain_strict(_masked_probs, x, mask, backend=backend)
    assert len(report.kernels) == 1 and not report.graphs[0].externs, str(report)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "name",
    ["all_last", "any_last", "all_bool", "any_keepdim", "all_int", "all_dims", "full_like"],
)
def test_all_any_full_like(backend, name):
    fns = {
        "all_last": lambda x: x.all(-1),
        "any_last": lambda x: x.any(-1),
        "all_bool": lambda x: (x > 0).all(),
        "any_keepdim": lambda x: (x > 0).any(1, keepdim=True),
        "all_int": lambda x: x.int().all(0),
        "all_dims": lambda x: torch.all(x == 0, dim=(0, 2)),
        "full_like": lambda x: torch.full_like(x.transpose(0, 2), 3.5) * 2,
    }
    x = torch.randn(3, 5, 7)
    x[0, 1] = 0
    x[1] = 0
    x[2, :, 3] = 0
    fn = fns[name]
    got, want = ember_compile(fn, backend)(x), fn(x)
    assert got.dtype == want.dtype and torch.equal(got, want), repro(backend=backend, case=name)
    report = explain_strict(fn, x, backend=backend)
    assert not report.graphs[0].externs, str(report)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inverted_boolean_mask_is_a_kernel(backend):
    """`~mask` (DeBERTa inverts its attention mask before filling) is logical not inside the kernel; an
    integer's `~` stays ATen's."""

    def fill_inverted(x, keep, bits):
        return x.masked_fill(~keep, -1e4).softmax(-1), ~bits

    x = torch.randn(2, 4, 8)
    keep = torch.rand(2, 1, 8) > 0.3
    bits = torch.randint(-50, 50, (5,))
    report = explain_strict(fill_inverted, x, keep, bits, backend=backend)
    assert report.graphs[0].externs == ["bitwise_not"], report
    got = ember_compile(fill_inverted, backend)(x, keep, bits)
    for g, w in zip(got, fill_inverted(x, keep, bits)):
        assert_close(g, w, rtol=1e-5, atol=1e-6, what="inverted mask", line=repro(backend=backend))
