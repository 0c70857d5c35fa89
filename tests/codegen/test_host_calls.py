"""What the generated code calls per kernel and per extern: the parts of a call's cost that are
host time (tiny_mlp's 16 layers at batch 1 on the CPU)."""

from __future__ import annotations

import torch

from ember.codegen.cpp import render_cpp
from ember.codegen.host import _fast_target
from tests.schedule.test_fusion import CPP, G

aten = torch.ops.aten


def _source(shape, reduce=False):
    b = G()
    x = b.input(*shape)
    y = b.reduce("max", x, (len(shape) - 1,)) if reduce else b.pw("mul", b.pw("exp", x), 0.5)
    (k,) = b.schedule(y).kernels
    return render_cpp(k, CPP)[0]


def test_small_kernels_open_no_parallel_region():
    # Entering `omp parallel if(0)` costs libgomp's setup (1.45 us of a 1.8 us 256-element GELU).
    small, small_rows, big = _source((256,)), _source((8, 32), reduce=True), _source((512, 1024))
    assert "omp parallel" not in small and "#pragma omp simd" in small
    assert "omp parallel" not in small_rows
    assert "#pragma omp parallel for simd" in big


def test_symbolic_size_kernel_threads_by_size_but_always_vectorizes():
    """The thread count's condition binds the parallel region only: a plain `if` on `parallel for
    simd` binds the simd too, and a symbolic kernel under the threshold ran scalar (GELU over
    [2, 16, 1024] took 640 us against 38 us static)."""
    import sympy

    s0 = sympy.Symbol("s0", integer=True, positive=True)
    b = G()
    y = b.pw("tanh", b.pw("mul", b.input(s0, 1024), 3.0))
    (k,) = b.schedule(y).kernels
    src = render_cpp(k, CPP)[0]
    assert "#pragma omp parallel for simd if(parallel: " in src, src


def test_float_max_keeps_nan_in_a_flag():
    src = _source((8, 1024), reduce=True)
    assert "reduction(max:" in src and "reduction(|:" in src and "_nan ? static_cast<float>(NAN)" in src


def test_matrix_products_call_the_torch_function_with_the_same_result():
    b, x, w = torch.randn(8), torch.randn(3, 5), torch.randn(5, 8)
    assert _fast_target(aten.addmm.default, {}) is torch.addmm
    assert _fast_target(aten.addmm.default, {"beta": 0.5, "alpha": 2}) is torch.addmm
    fast = _fast_target(aten.addmm.default, {"beta": 0.5, "alpha": 2})
    torch.testing.assert_close(fast(b, x, w, beta=0.5, alpha=2), aten.addmm.default(b, x, w, beta=0.5, alpha=2))
    assert _fast_target(aten.mm.default, {}) is torch.mm
    # Anything else, or a keyword the torch function may spell differently, keeps the overload.
    assert _fast_target(aten.mm.default, {"self": x}) is aten.mm.default
    assert _fast_target(aten.convolution.default, {}) is aten.convolution.default


def test_host_program_names_externs_after_their_ops():
    """The printed host program says what each extern call does (`mm_6(a0, a1)`), not `c6(...)`."""
    import re

    from tests.helpers import assert_close, explain_strict

    a, b = torch.randn(8, 8), torch.randn(8, 8)

    def program(a, b):
        return torch.sort(a @ b, dim=1).values.relu().cumsum(0)

    report = explain_strict(program, a, b, heuristics="cpp.gemm_template=0")  # the product an extern too
    assert_close(
        torch.compile(program, backend="ember")(a, b), program(a, b), rtol=1e-5, atol=1e-5, what="out", line=""
    )
    (graph,) = report.graphs
    calls = re.findall(r"= (\w+)\(", graph.host_source)
    assert {re.sub(r"_\d+$", "", c) for c in calls} >= {"mm", "sort", "cumsum"}, graph.host_source
    assert not re.search(r"\bc\d+\(", graph.host_source), graph.host_source


def test_profile_ranges_name_each_kernel_in_a_profile():
    """Under `profile_ranges` the host program wraps each kernel launch in a profiler range named after the
    kernel, so a CPU profile shows ember's kernels one by one; without it, no range and no call to make one."""
    import ember
    from tests.helpers import ember_compile

    def two_kernels(x):  # a row reduction, then a pointwise pass that reads its result
        return (x - x.amax(-1, keepdim=True)).exp() * 2 + x.sum(0)

    x = torch.randn(64, 128)
    with ember.config.override(profile_ranges=True):
        ranged = ember_compile(two_kernels, "cpp")
        torch.testing.assert_close(ranged(x), two_kernels(x))
        with torch.profiler.profile() as prof:
            ranged(x)
    names = {e.key for e in prof.key_averages()}
    kernels = {n for n in names if n.startswith("k") and n[1:].isdigit()}
    assert len(kernels) >= 2, names
    torch._dynamo.reset()
    with ember.config.override(profile_ranges=False):
        plain = ember_compile(two_kernels, "cpp")
        with torch.profiler.profile() as prof:
            plain(x)
    assert not {e.key for e in prof.key_averages()} & kernels
