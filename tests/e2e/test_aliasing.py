"""Kernels whose output is written in place of a buffer they read (a mutated input, or an input's
last use): the generated code must not assume the two are distinct. With both pointers declared
`__restrict__`, `x.add_(1); x.sum()` sums elements the kernel has already overwritten whenever the
length is not a multiple of the vector width.

Lengths that are and are not multiples of the vector width (16 floats with AVX-512, 8 with AVX2),
for both code generators; a compile with a symbolic length covers the rest."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import BACKENDS, assert_close, assert_no_fallback, ember_compile, reports, tensors


def _add_then_sum(x):
    x.add_(1)
    return x.sum()


def _add_then_mean(x):
    x.add_(0.5)
    return x.mean()


def _sgd_then_square_sum(p):
    g = torch.ones_like(p)
    p.add_(g, alpha=-0.1)
    return (p * p).sum()


def _scale_then_norm(x):
    x.mul_(2)
    return torch.linalg.vector_norm(x)


def _product_then_epilogue_in_place(x):
    y = torch.mm(x.view(-1, 1), torch.ones(1, 3, dtype=x.dtype, device=x.device))  # a fresh extern result
    z = y + 1  # written over y (its last use) by the kernel that also sums it
    return z, z.sum()


PROGRAMS = [_add_then_sum, _add_then_mean, _sgd_then_square_sum, _scale_then_norm, _product_then_epilogue_in_place]
# The product stays ATen's extern (ember's C++ GEMM template off): its result is what is written in place.
OPTIONS = {_product_then_epilogue_in_place: {"heuristics": "cpp.gemm_template=0"}}
LENGTHS = {"cpp": (12, 16, 100, 1001), "triton": (15, 100)}


def _check(fn, backend: str, x: torch.Tensor, compiled=None) -> None:
    line = f"repro: {fn.__name__}(x) with x={x.dtype} {list(x.shape)}, backend={backend}"
    mine, theirs = x.clone(), x.clone()
    compiled = compiled or ember_compile(fn, backend)
    got, want = compiled(mine), fn(theirs)
    tol = {"rtol": 1e-5, "atol": 1e-5} if x.dtype.is_floating_point else {"rtol": 0, "atol": 0}
    for i, (a, b) in enumerate(zip(tensors(got), tensors(want), strict=True)):
        assert_close(a, b, **tol, what=f"result {i}", line=line)
    assert_close(mine, theirs, **tol, what="the updated input", line=line)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_in_place_update_then_reduction(backend, fn):
    for n in LENGTHS[backend]:
        torch._dynamo.reset()
        with reports() as report:
            _check(fn, backend, torch.randn(n), ember_compile(fn, backend, **OPTIONS.get(fn, {})))
        assert_no_fallback(report, f"repro: {fn.__name__} n={n} {backend}")
        assert any("in place" in g.memory and " 0 in place" not in g.memory for g in report.graphs), report.graphs


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_in_place_update_then_sum_other_dtypes(dtype):
    for n in (100, 1001):
        torch._dynamo.reset()
        _check(_add_then_sum, "cpp", torch.arange(n, dtype=dtype) % 7)


def test_in_place_rows_then_row_sums():
    def f(x):
        x.add_(1)
        return x.sum(dim=1)

    for shape in ((7, 33), (5, 100)):
        torch._dynamo.reset()
        _check(f, "cpp", torch.randn(shape))


def test_in_place_update_with_symbolic_length():
    compiled = ember_compile(_add_then_sum, "cpp", dynamic=True)
    for n in (12, 13, 31, 100, 1000, 1001):
        _check(_add_then_sum, "cpp", torch.randn(n), compiled)


def test_shared_buffers_lose_restrict_and_others_keep_it():
    with reports() as report:
        _check(_add_then_sum, "cpp", torch.randn(100))
    (graph,) = report.graphs
    (kernel,) = graph.kernels
    signature = kernel.source.split("{", 1)[0]
    # The input read and the new value written over it share memory; the sum's output does not.
    assert signature.count("__restrict__") == 1, signature
    assert "__restrict__ out_" in signature and "float* in_" in signature, signature
