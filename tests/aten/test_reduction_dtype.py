"""Reductions that name a `dtype` (aten/lowerings/reductions.py) convert their input first, as eager does, and
run in ember's kernels: torch's backward of a bfloat16 linear layer sums the bias gradient with dtype=float32."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ON_DEVICES, assert_close, assert_no_fallback, ember_compile, reports, repro


def sum_to_float(x):
    return torch.sum(x, dim=0, keepdim=True, dtype=torch.float32)


def sum_all_to_double(x):
    return torch.sum(x * 2, dtype=torch.float64)


def mean_to_float(x):
    return torch.mean(x.sin(), dim=(1, 2), dtype=torch.float32)


def sum_ints_to_float(x):  # an integer input converted first: no integer overflow, a float result
    return torch.sum(x.clamp(-100, 100).to(torch.int8), dim=1, dtype=torch.float32)  # in int8's range everywhere


PROGRAMS = [sum_to_float, sum_all_to_double, mean_to_float, sum_ints_to_float]


@pytest.mark.parametrize("backend,device", ON_DEVICES)
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_reduction_with_dtype_matches_eager_in_a_kernel(backend, device, fn):
    torch.manual_seed(0)
    x = (torch.randn(64, 3, 40, device=device) * 30).to(torch.bfloat16)
    line = repro(program=fn.__name__, backend=backend, device=device)
    with reports() as report:
        got = ember_compile(fn, backend)(x)
    want = fn(x)
    assert_no_fallback(report, line)
    assert got.dtype == want.dtype, line
    assert_close(got, want, rtol=1e-5, atol=1e-4, what=fn.__name__, line=line)
    externs = [str(e) for g in report.graphs for e in g.externs]
    assert not externs, f"ran as ATen: {externs}\n{line}"
