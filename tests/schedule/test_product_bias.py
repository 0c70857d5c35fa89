"""A float32 addmm's bias as ember's add on the C++ target (schedule/product_bias.py): the product runs as
`mm` and the bias joins the kernel that reads it; other dtypes, other targets and the setting off keep
`addmm`. Each case against eager. The products here are ATen's (ember's C++ GEMM template off), as
the template's own are where it does not apply; with it, the bias joins the template's epilogue."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers import assert_close, assert_no_fallback, ember_compile, reports, repro


def _linear_relu_linear(x, w1, b1, w2, b2):
    return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


def _args(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(6, 16), (24, 16), (24,), (8, 24), (8,)]
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def _run(backend: str, args, **options):
    options.setdefault("heuristics", "cpp.gemm_template=0")
    with reports() as report:
        out = ember_compile(_linear_relu_linear, backend, **options)(*args)
    assert_no_fallback(report, repro(backend=backend, options=options))
    (graph,) = report.graphs
    return out, graph


def test_the_bias_joins_the_kernel_reading_the_product():
    args = _args()
    out, graph = _run("cpp", args)
    assert graph.externs == ["mm", "mm"], graph.externs
    # The first product's bias and ReLU in one kernel, the second's bias in the output's: two kernels.
    assert len(graph.kernels) == 2, graph.kernels
    assert_close(out, _linear_relu_linear(*args), rtol=1e-5, atol=1e-5, what="out", line=repro(case="cpp"))


def test_the_setting_off_other_dtypes_and_the_gpu_target_keep_addmm():
    args = _args()
    want = _linear_relu_linear(*args)
    out, graph = _run("cpp", args, heuristics="lower.product_bias_as_add=0,cpp.gemm_template=0")
    assert graph.externs == ["addmm", "addmm"], graph.externs
    assert_close(out, want, rtol=1e-5, atol=1e-5, what="off", line=repro(heuristics="lower.product_bias_as_add=0"))
    out, graph = _run("triton", args)  # cuBLAS adds a bias in its own epilogue
    assert "addmm" in graph.externs, graph.externs
    assert_close(out, want, rtol=1e-5, atol=1e-5, what="triton", line=repro(backend="triton"))
    bf16 = _args(torch.bfloat16)
    out, graph = _run("cpp", bf16)  # one rounding of product and bias together, as eager's
    assert graph.externs == ["addmm", "addmm"], graph.externs
    assert_close(out, _linear_relu_linear(*bf16), rtol=2e-2, atol=2e-2, what="bf16", line=repro(dtype="bf16"))
