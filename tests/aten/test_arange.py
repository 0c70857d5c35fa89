"""An integer `arange` is positions inside ember's kernels (aten/lowerings/elementwise.py), not an ATen call:
T5's relative positions, position ids, strided index lists; a floating-point one stays ATen's."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ON_DEVICES, assert_close, assert_no_fallback, ember_compile, reports, repro


def relative_positions(q):  # T5's relative position buckets start from these
    n = q.shape[0]
    context = torch.arange(n, device=q.device)[:, None]
    memory = torch.arange(n, device=q.device)[None, :]
    return q.sum(dim=1, keepdim=True) + (memory - context).abs()


def positions_returned(x):
    return x * 2, torch.arange(x.shape[0], device=x.device)


def strided_and_narrow(x):  # a start, a negative step, int32
    return x + torch.arange(10, 0, -3, device=x.device) + torch.arange(3, 15, 3, dtype=torch.int32, device=x.device)


def every_other_row(x):
    return x[torch.arange(0, x.shape[0], 2, device=x.device)] * 3


PROGRAMS = [relative_positions, positions_returned, strided_and_narrow, every_other_row]


@pytest.mark.parametrize("backend,device", ON_DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_integer_arange_is_computed_in_kernels(backend, device, dynamic, fn):
    x = torch.randn(8, 4, device=device)
    line = repro(program=fn.__name__, backend=backend, device=device, dynamic=dynamic)
    with reports() as report:
        got = ember_compile(fn, backend, dynamic=dynamic)(x)
    assert_no_fallback(report, line)
    want = fn(x)
    for g, w in zip(got, want) if isinstance(want, tuple) else [(got, want)]:
        assert g.dtype == w.dtype, line
        assert_close(g, w, rtol=1e-6, atol=1e-6, what=fn.__name__, line=line)
    externs = [str(e) for g in report.graphs for e in g.externs]
    assert not any("arange" in e for e in externs), f"{externs}\n{line}"


def test_floating_arange_stays_aten():
    fn = lambda x: x + torch.arange(0, 1, 0.25)
    x = torch.randn(4)
    with reports() as report:
        got = ember_compile(fn, "cpp")(x)
    torch.testing.assert_close(got, fn(x))
    assert any("arange" in str(e) for g in report.graphs for e in g.externs), report
