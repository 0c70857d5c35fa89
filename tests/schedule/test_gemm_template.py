"""ember's GEMM template (schedule/gemm.py, codegen/gemm_triton.py) under Triton's CPU interpreter.

With `gemm=template` forced, every mm / addmm / bmm runs as the template, forward and backward
(the backward's products are mm's of transposed views), and pointwise consumers fuse into its
epilogue. Each case compares outputs and gradients with eager; low-precision cases compare
their error against an fp32 reference with eager's own. Then, per schedule: how many kernels
and externs, and the bytes the fused template moves.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import (
    assert_close,
    assert_no_fallback,
    assert_not_worse,
    compiled_graph,
    ember_compile,
    forward_backward,
    fresh_inputs,
    reports,
    repro,
)


def _linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def _residual_scale(x, w, r):
    return (x @ w) * 0.5 + r


def _bmm_transposed(a, b):
    return torch.relu(torch.bmm(a, b.transpose(1, 2)))


def _transposed_a(x, w):
    return torch.sigmoid(x.t() @ w)


def _linear_3d_residual(x, w, b, r):
    return F.linear(x, w, b) + r  # [B, T, C]: a 2-D addmm whose epilogue runs over a reshape


def _cast_epilogue(x, w):
    return (x @ w).float() * 2.0


def _r(*shape):
    return torch.randn(*shape)


# name, function, inputs (fp32; low-precision cases round them), dtypes to run
CASES = [
    ("mm", torch.mm, lambda: [_r(32, 48), _r(48, 40)], (torch.float32,)),
    ("mm_odd", torch.mm, lambda: [_r(33, 17), _r(17, 29)], (torch.float32, torch.bfloat16)),
    ("linear_bias_gelu", _linear_gelu, lambda: [_r(33, 24), _r(40, 24), _r(40)], (torch.float32, torch.bfloat16)),
    ("residual_scale", _residual_scale, lambda: [_r(20, 36), _r(36, 24), _r(20, 24)], (torch.float32,)),
    ("bmm_transposed_b", _bmm_transposed, lambda: [_r(3, 17, 24), _r(3, 20, 24)], (torch.float32, torch.float16)),
    ("transposed_a", _transposed_a, lambda: [_r(24, 18), _r(24, 30)], (torch.float32,)),
    ("linear_3d_residual", _linear_3d_residual, lambda: [_r(2, 9, 24), _r(16, 24), _r(16), _r(2, 9, 16)], (torch.float32,)),
    ("cast_epilogue", _cast_epilogue, lambda: [_r(16, 32), _r(32, 24)], (torch.bfloat16,)),
]  # fmt: skip


@pytest.mark.parametrize("name,fn,make,dtypes", CASES, ids=[c[0] for c in CASES])
def test_template_matches_eager_forward_and_backward(name, fn, make, dtypes):
    base = make()
    for dtype in dtypes:
        line = repro(case=name, dtype=dtype, inputs=base)
        inputs = fresh_inputs(base, dtype)
        with reports() as report:
            compiled = ember_compile(fn, "triton", gemm="template")
            outs, grads = forward_backward(compiled, [], inputs, grad_seed=1, train=True)
        assert_no_fallback(report, line)
        externs = [e for g in report.graphs for e in g.externs]
        assert not any("mm" in e for e in externs), f"{name}: products ran on ATen: {externs}\n{line}"
        eager_outs, eager_grads = forward_backward(fn, [], fresh_inputs(base, dtype), grad_seed=1, train=True)
        if dtype == torch.float32:
            for got, want in zip(outs + grads, eager_outs + eager_grads):
                assert_close(got, want, rtol=1e-4, atol=1e-4, what=name, line=line)
        else:
            # The same rounded inputs in fp32 are the reference; ember's error may not exceed eager's by much.
            ref_inputs = [x.detach().float().requires_grad_(True) for x in inputs]
            ref_outs, ref_grads = forward_backward(fn, [], ref_inputs, grad_seed=1, train=True)
            for got, eager, ref in zip(outs + grads, eager_outs + eager_grads, ref_outs + ref_grads):
                assert_not_worse(got, eager, ref.to(got.dtype).float() if got.dtype != ref.dtype else ref,
                                 what=f"{name} {dtype}", line=line, atol=2**-7)  # fmt: skip


def test_epilogue_fuses_into_the_template():
    """linear + bias + gelu: one template kernel that reads x, w and the bias and writes the result
    once. The ATen path runs the product as an extern and the epilogue as a second kernel that
    reads the product back."""
    m, k, n = 33, 24, 40
    x, w, b = _r(m, k), _r(n, k), _r(n)
    want = _linear_gelu(x, w, b)
    out, graph = compiled_graph(_linear_gelu, [x, w, b], gemm="template")
    line = repro(case="linear_bias_gelu", gemm="template")
    assert_close(out, want, rtol=1e-4, atol=1e-4, what="out", line=line)
    assert not graph.externs, f"{graph}\n{line}"
    (kernel,) = graph.kernels
    assert "addmm" in kernel.ops and "tanh" in kernel.ops, f"{graph}\n{line}"
    assert graph.bytes == 4 * (m * k + k * n + n + m * n), f"{graph.bytes}\n{graph}\n{line}"
    assert kernel.flops >= 2 * m * n * k
    fused = [f for f in graph.fusion if f.accepted and "epilogue fused into the GEMM template" in f.reason]
    assert len(fused) == 1 and "tanh" in fused[0].reason, f"{graph}\n{line}"

    out, aten = compiled_graph(_linear_gelu, [x, w, b], gemm="aten")
    assert_close(out, want, rtol=1e-5, atol=1e-5, what="out (aten)", line=line)
    assert aten.externs == ["addmm"] and len(aten.kernels) == 1, f"{aten}\n{line}"
    assert aten.bytes == 4 * 2 * m * n, f"{aten.bytes}\n{aten}\n{line}"  # the epilogue reads the product back
    assert any("ATen: gemm=aten" in f.reason for f in aten.fusion), f"{aten}\n{line}"


def test_refusals_are_explained():
    """A reduction over the product (softmax) and a second product do not join the template; the
    product is stored for them and each refusal says why."""

    def scores_softmax(q, k, v):
        return (q @ k.t()).softmax(-1) @ v

    q, k, v = _r(16, 8), _r(24, 8), _r(24, 8)
    out, graph = compiled_graph(scores_softmax, [q, k, v], gemm="template", patterns=False)
    line = repro(case="scores_softmax")
    assert_close(out, scores_softmax(q, k, v), rtol=1e-4, atol=1e-4, what="out", line=line)
    assert not graph.externs and len(graph.kernels) == 3, f"{graph}\n{line}"
    reasons = " | ".join(f.reason for f in graph.fusion if not f.accepted)
    assert "a GEMM epilogue is element-wise" in reasons, f"{graph}\n{line}"


def test_auto_means_aten_without_a_gpu():
    x, w = _r(16, 32), _r(32, 8)
    _, graph = compiled_graph(torch.mm, [x, w], gemm="auto")
    assert graph.externs == ["mm"], str(graph)
    assert any("measures only on a GPU" in f.reason for f in graph.fusion), str(graph)
