"""Reductions against eager: sum/mean/amax/amin/var over single dims, several dims, and all dims.

Each reduction reads a pointwise expression of its input (x * 1.5 + 0.25), which must fuse
into the reduction's kernel: every row of the table is one kernel.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    BACKENDS,
    assert_close,
    assert_no_fallback,
    assert_not_worse,
    ember_compile,
    max_error,
    reports,
    repro,
)

SHAPE = (6, 10, 12)
DIMS = [0, 1, -1, (0, 2), None]  # None: every dim (a full reduction)


def _reduce(op: str, x: torch.Tensor, dim, keepdim: bool) -> torch.Tensor:
    if dim is None and not keepdim:
        dim_args: dict = {}  # x.sum(): a 0-dim result
    else:
        dim_args = {"dim": tuple(range(x.dim())) if dim is None else dim, "keepdim": keepdim}
    if op == "var":
        return x.var(**dim_args)
    if op == "var_unbiased0":
        return x.var(correction=0, **dim_args)
    return getattr(x, op)(**dim_args)


OPS = ["sum", "mean", "amax", "amin", "var", "var_unbiased0"]


def program(op, dim, keepdim):
    def fn(x):
        return _reduce(op, x * 1.5 + 0.25, dim, keepdim)

    return fn


def _cases():
    for backend in BACKENDS:
        for op in OPS:
            for dim in DIMS:
                for keepdim in (False, True):
                    yield pytest.param(backend, op, dim, keepdim, id=f"{backend}-{op}-dim{dim}-keep{keepdim}")


def _run(backend, op, dim, keepdim, dynamic, dtype=torch.float32, shapes=(SHAPE,)):
    fn = program(op, dim, keepdim)
    compiled = ember_compile(fn, backend, dynamic=dynamic)
    with reports() as report:
        for shape in shapes:
            x = torch.randn(shape, dtype=dtype)
            line = repro(op=op, dim=dim, keepdim=keepdim, backend=backend, dynamic=dynamic, dtype=dtype, input=x)
            out, expected = compiled(x), fn(x)
            if dtype == torch.float32:
                assert_close(out, expected, rtol=1e-5, atol=1e-5, what=op, line=line)
            else:
                assert out.shape == expected.shape, f"{tuple(out.shape)} != {tuple(expected.shape)}\n{line}"
                assert_not_worse(out, expected, fn(x.float()), what=op, line=line)
    assert_no_fallback(report, line)
    assert len(report.graphs) == 1, f"{len(report.graphs)} graphs compiled (a recompile for the second size?)\n{line}"
    for g in report.graphs:
        assert len(g.kernels) == 1 and not g.externs, f"expected one kernel:\n{g}\n{line}"


@pytest.mark.parametrize("backend,op,dim,keepdim", list(_cases()))
def test_reduction_static(backend, op, dim, keepdim):
    _run(backend, op, dim, keepdim, dynamic=False)


# Dynamic shapes: the whole table on cpp; under Triton's interpreter (slow with symbolic
# sizes) one row per op, covering each kind of dims once.
_TRITON_DYNAMIC = [
    ("sum", -1, False),
    ("mean", (0, 2), True),
    ("amax", 0, False),
    ("amin", None, False),
    ("var", 1, True),
    ("var_unbiased0", None, True),
]


def _dynamic_cases():
    for param in _cases():
        backend, op, dim, keepdim = param.values
        if backend == "cpp" or (op, dim, keepdim) in _TRITON_DYNAMIC:
            yield param


@pytest.mark.parametrize("backend,op,dim,keepdim", list(_dynamic_cases()))
def test_reduction_dynamic(backend, op, dim, keepdim):
    _run(backend, op, dim, keepdim, dynamic=True, shapes=(SHAPE, (7, 9, 13)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "op,dim,keepdim", [("sum", -1, False), ("mean", (0, 2), True), ("var", 1, False), ("amax", None, False)]
)
def test_reduction_bfloat16(backend, op, dim, keepdim):
    _run(backend, op, dim, keepdim, dynamic=False, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_row_reduction(backend):
    """A row longer than one Triton block (and the C++ vector width): sum and amax of 3 x 5000, split
    into 8 chunks of 625 and a second stage over them (3 x 20000 takes the same two kernels with 32
    chunks: four times the Triton interpreter's work)."""

    def fn(x):
        return x.sum(-1), x.amax(-1)

    x = torch.randn(3, 5000)
    line = repro(backend=backend, input=x)
    with reports() as report:
        out = ember_compile(fn, backend)(x)
    for got, want in zip(out, fn(x)):
        assert_close(got, want, rtol=1e-5, atol=1e-4, what="long row", line=line)
    assert_no_fallback(report, line)
    # However the rows are split, sum and amax share the pass over x: it is read once.
    moved = sum(k.bytes for k in report.kernels)
    assert moved < 1.5 * x.nbytes, f"{moved} bytes moved for a {x.nbytes}-byte input:\n{report}\n{line}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sum", "amax", "var_unbiased0"])
@pytest.mark.parametrize("shape,dim", [((1,), 0), ((4, 1, 3), 1)], ids=["x[1].dim0", "x[4,1,3].dim1"])
def test_reduction_over_size_one_dims(backend, op, shape, dim):
    # Dimension merging drops size-1 dims, so the kernel reduces over no loop dim at all; Triton rendered a
    # looped reduction anyway, using an RBLOCK and rnumel it never declared (found by ember fuzz, seed 7).
    _run(backend, op, dim, False, dynamic=False, shapes=(shape,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_over_size_one_dim(backend):
    # Two reductions (max, then sum of exp) and an epilogue, all over a dim of size 1.
    def fn(x):
        return torch.softmax(x * 2, dim=1), torch.logsumexp(x, dim=1)

    x = torch.randn(4, 1, 3)
    line = repro(backend=backend, input=x)
    with reports() as report:
        out = ember_compile(fn, backend)(x)
    for got, want in zip(out, fn(x)):
        assert_close(got, want, rtol=1e-5, atol=1e-6, what="softmax over a size-1 dim", line=line)
    assert_no_fallback(report, line)


# Long rows on the CPU, against float64: no worse than 4x eager's error (or 4 ulps, where eager is
# exact). One running value per SIMD lane made a sum of 2^24 + 43 tenths 1% low, and the variance of
# rows of 4M elements 50 ulps off (schedule/split.py, codegen/cpp.py's ember_cascade).
def _tenths(n: int) -> torch.Tensor:
    return torch.full((n,), 0.1)


LONG_ROWS = [
    ("sum of tenths", lambda x: x.sum(), lambda: _tenths(2**24 + 43), False),
    ("mean of rows", lambda x: x.mean(1), lambda: torch.rand(2, 2**22 + 9), True),
    ("sum over two loops", lambda x: x.sum((0, 2)), lambda: torch.rand(65, 2, 2**16 + 1), True),
    ("var of rows", lambda x: x.var(1), lambda: torch.rand(2, 2**22 + 9) + 3, False),
    (
        "layer_norm",
        lambda x: torch.nn.functional.layer_norm(x, x.shape[1:]),
        lambda: torch.rand(2, 2**22 + 9) + 3,
        False,
    ),
    ("norm", lambda x: x.norm(), lambda: torch.rand(2**24 + 43), False),
]


@pytest.mark.parametrize("name,fn,make,dynamic", LONG_ROWS, ids=[case[0].replace(" ", "_") for case in LONG_ROWS])
def test_long_rows_are_as_accurate_as_eager(name, fn, make, dynamic):
    x = make()
    line = repro(op=name, backend="cpp", dynamic=dynamic, input=x)
    with reports() as report:
        got = ember_compile(fn, "cpp", dynamic=dynamic)(x)
    assert_no_fallback(report, line)
    want = fn(x.double())
    scale = want.abs().max().item()
    err, eager_err = max_error(got, want) / scale, max_error(fn(x), want) / scale
    bound = 4 * max(eager_err, 2**-24)
    assert err <= bound, f"{name}: relative error {err:.3g}, eager's {eager_err:.3g}\n{line}"
