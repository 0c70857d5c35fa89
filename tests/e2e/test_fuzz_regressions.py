"""Bugs the fuzzer (ember/tools/fuzz/) found, each kept as a program compared with eager.

Each case names the fuzz seed and program it came from (`python -m ember.tools.fuzz --seed S
--only I` regenerates it) and is cut down to the ops that matter.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close, repro


def _squeeze_of_guarded_size_one(x):
    # seed 100, program 64: with dynamic shapes the slice's length is (s + 1) // 3, which a guard
    # makes 1; squeeze(1) dropped the dim in eager but ember kept it (wrong rank).
    v = (x + 1.25)[:, 1::3]
    return torch.floor(v).squeeze(1), v


def _row_constant_stored_along_the_row(x):
    # seed 2026, programs 457, 552, ... (fell back: g++ 'l1' was not declared): y = x.expand(3) * 1 does
    # not vary along the reduced dim, yet it is stored at every element of the row; the store was
    # rendered after the row loop, outside the scope of its loop variable.
    y = x.expand(3) * 1
    return y - y.amax(0, keepdim=True), y


def _cat_of_an_empty_matmul(x1, x5, x7):
    # seed 2026, program 1987 (dynamic shapes; fell back: index expression nan): x1 @ x5 reshapes x1
    # [s, 1, 0] to [s, 0]; the reshape's index map divided by the zero size.
    return torch.cat([x1 @ x5, x7], 0) * 2


# name -> (program, input shapes, dynamic, strict). Not strict: the program may fall back to eager (the
# squeeze's slice length is Max(1, (s + 1) // 3), a size expression ember does not render yet).
CASES = {
    "squeeze_of_guarded_size_one": (_squeeze_of_guarded_size_one, [(7, 4, 7)], True, False),
    "row_constant_stored_along_the_row": (_row_constant_stored_along_the_row, [(1,)], False, True),
    "cat_of_an_empty_matmul": (_cat_of_an_empty_matmul, [(5, 1, 0), (0, 17), (5, 1, 17)], True, True),
}


def _clamp_transposed_divide(x, w):
    # seed 2026, program 200 (gradients): the forward saves `clamp(x).transpose(0, -1)` for the
    # backward. ember's forward returned it in its own layout, AOTAutograd recorded eager's
    # (x is a permuted input), and the backward kernels read it with the recorded strides.
    return torch.div(w, torch.clamp(x, -2.0, 3.0).transpose(0, -1))


def test_backward_reads_a_saved_activation_in_the_recorded_layout():
    base = torch.randn(5, 17, 8)
    x = base.permute(0, 2, 1).requires_grad_(True)  # strides (136, 1, 8)
    w = torch.randn(1, 1, 5, requires_grad=True)
    cot = torch.randn(17, 8, 5)
    line = repro(program="clamp_transposed_divide", inputs=[x, w])
    compiled = torch.compile(_clamp_transposed_divide, backend="ember", options={"backend": "cpp", "strict": True})
    got = compiled(x, w)
    got_grads = torch.autograd.grad(got, [x, w], cot)
    want = _clamp_transposed_divide(x, w)
    want_grads = torch.autograd.grad(want, [x, w], cot)
    assert_close(got, want, rtol=1e-5, atol=1e-5, what="output", line=line)
    for name, g, e in zip(("x", "w"), got_grads, want_grads):
        assert_close(g, e, rtol=1e-4, atol=1e-4, what=f"grad of {name}", line=line)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("name", list(CASES))
def test_fuzz_regression(name, backend):
    fn, shapes, dynamic, strict = CASES[name]
    inputs = [torch.randn(s) for s in shapes]
    line = repro(program=name, dynamic=dynamic, inputs=inputs, backend=backend)
    expected = fn(*inputs)
    got = torch.compile(fn, backend="ember", dynamic=dynamic, options={"backend": backend, "strict": strict})(*inputs)
    expected, got = (expected, got) if isinstance(expected, tuple) else ((expected,), (got,))
    assert len(got) == len(expected), line
    for k, (g, e) in enumerate(zip(got, expected)):
        assert_close(g, e, rtol=1e-5, atol=1e-6, what=f"output {k}", line=line)


def _exp_of_transposed_input(x, s):
    # seed 2026, program 1294 (dynamic shapes, gradients): exp(x) of a transposed x is saved for the
    # backward; eager's layout keeps x's column-major strides (symbolic here), ember wrote it row-major,
    # and the backward read it with the recorded strides.
    e = torch.exp(x)
    d = torch.div(s, e)
    return torch.div(torch.maximum(e, d), d), torch.exp2(torch.sub(s, d).t())


@pytest.mark.parametrize("dynamic", [False, True])
def test_saved_activation_with_symbolic_strides(dynamic):
    x = torch.randn(31, 33).t().requires_grad_(True)
    s = torch.randn((), requires_grad=True)
    line = repro(program="exp_of_transposed_input", dynamic=dynamic, inputs=[x, s])
    compiled = torch.compile(_exp_of_transposed_input, backend="ember", dynamic=dynamic, options={"strict": True})
    got = compiled(x, s)
    want = _exp_of_transposed_input(x, s)
    cot = [torch.randn(o.shape) for o in want]
    got_grads = torch.autograd.grad(got, [x, s], cot)
    want_grads = torch.autograd.grad(want, [x, s], cot)
    for k, (g, e) in enumerate(zip(got, want)):
        assert_close(g, e, rtol=1e-4, atol=1e-4, what=f"output {k}", line=line)
    for name, g, e in zip(("x", "s"), got_grads, want_grads):
        assert_close(g, e, rtol=1e-3, atol=1e-3, what=f"grad of {name}", line=line)


def test_triton_index_width_with_a_symbolic_buffer_size():
    # ember fuzz --backend triton (interpreter, seed 7): a kernel whose loops and indices need no size
    # symbol but which reads a buffer of symbolic size ([s, 5], only row 0) asked `5*s >= 2**31` of sympy
    # and raised (the graph fell back). A size that can grow on a later call now means int64 indices.
    def fn(x):
        return x[0] * 2

    compiled = torch.compile(fn, backend="ember", options={"backend": "triton", "strict": True})
    for rows in (3, 4):
        x = torch.randn(rows, 5)
        torch._dynamo.mark_dynamic(x, 0)
        line = repro(program="x[0] * 2", inputs=[x], dynamic="dim 0")
        assert_close(compiled(x), fn(x), rtol=1e-6, atol=1e-6, what="output", line=line)


def _var_of_one_promoted_bf16_value(x, y):
    # seed 2026, program 1975 (mismatch: inf, eager nan): var of one bf16 element. The mean read the
    # value through an explicit cast (rounded to bf16), x - mean through type promotion (unrounded), so
    # the deviation was 2^-9 instead of 0 and the 0/0 of correction=1 became inf.
    return torch.var(torch.add(x, y, alpha=0.5), dim=0, correction=1, keepdim=True)


def _cast_and_promotion_see_one_value(x, y):
    v = x + y  # bf16: eager rounds it; a cast and a promotion to float32 must both see the rounded value
    return v.float() - v, v.float() * 2


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("fn", [_var_of_one_promoted_bf16_value, _cast_and_promotion_see_one_value])
def test_a_widened_low_precision_value_is_rounded_first(fn, backend):
    # 1 + 0.5 * 1.5 * 2^-7 lies between two bf16 values: rounding it is visible.
    x = torch.tensor([1.0, 1.0, 3.0], dtype=torch.bfloat16)[: 1 if fn is _var_of_one_promoted_bf16_value else 3]
    y = torch.full_like(x, 1.5 * 2**-7)
    line = repro(program=fn.__name__, inputs=[x, y], backend=backend)
    want = fn(x, y)
    got = torch.compile(fn, backend="ember", options={"backend": backend, "strict": True})(x, y)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for k, (g, e) in enumerate(zip(got, want)):
        assert g.dtype == e.dtype, line
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True, msg=lambda m, k=k: f"output {k}: {m}\n{line}")


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_triton_interpreter_casts_integers_to_bf16_by_value(dtype):
    # ember fuzz --backend triton --seed 7, program 36 (mismatch: 0 instead of 11.966): Triton's CPU
    # interpreter reinterprets an integer's bits as bf16 (True became 9.2e-41); the cast goes through fp32.
    def fn(x):
        return x.to(torch.bfloat16) * 3

    x = torch.tensor([[1, 0, 3, -5, 200]]).to(dtype)
    line = repro(program="x.to(bfloat16) * 3", inputs=[x], backend="triton")
    got = torch.compile(fn, backend="ember", options={"backend": "triton", "strict": True})(x)
    assert_close(got, fn(x), rtol=0, atol=0, what="output", line=line)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("op", ["var", "std"])
def test_var_backward_with_dynamic_shapes(op, backend):
    # seed 2026, programs 191, 619, 1029, 1676 (fell back: extern sym_float returns SymFloat): var's
    # backward scales by 2.0 / (float(N) - 1.0), a float computed from a size. It is now a 0-d float64
    # value computed in the kernel, as eager computes the Python float in double.
    def fn(x):
        return getattr(torch, op)(x * 2, dim=0, keepdim=True)

    compiled = torch.compile(fn, backend="ember", dynamic=True, options={"backend": backend, "strict": True})
    for rows in (5, 7):
        x = torch.randn(rows, 3, dtype=torch.float32).requires_grad_(True)
        line = repro(program=f"{op}(x * 2, dim=0)", inputs=[x], backend=backend, dynamic=True)
        got, want = compiled(x), fn(x)
        cot = torch.randn(want.shape)
        (g_got,), (g_want,) = torch.autograd.grad(got, [x], cot), torch.autograd.grad(want, [x], cot)
        assert_close(got, want, rtol=1e-5, atol=1e-6, what="output", line=line)
        assert_close(g_got, g_want, rtol=1e-5, atol=1e-6, what="grad", line=line)


def test_a_symbolic_float_an_op_reads_as_a_keyword_falls_back():
    # Only positional scalar operands of mul/div/add/sub may be a symbolic float; add's alpha would reach
    # an ATen call as a tensor: the graph runs eagerly, with a warning naming the cause.
    def fn(x, y):
        return torch.add(y, x, alpha=2.0 / (x.shape[0] - 1.0))

    compiled = torch.compile(fn, backend="ember", dynamic=True)
    for rows in (5, 7):
        x, y = torch.randn(rows, 3), torch.randn(rows, 3)
        with pytest.warns(UserWarning, match="symbolic float used by add"):
            got = compiled(x, y)
        assert_close(got, fn(x, y), rtol=1e-6, atol=1e-6, what="output", line=repro(rows=rows))
        torch._dynamo.reset()


def _softmax_of_an_empty_tensor(x1):
    # seed 2026, programs 1219, 1783, 1910 (GPU: Triton CompilationError; the interpreter never runs a
    # kernel over zero elements, so only compiling showed it): a kernel all of whose outputs are empty
    # indexed with a loop variable of a dim merged away. Such a kernel is neither generated nor launched.
    v = torch.softmax(torch.where(x1 > 0, x1, 3.0), dim=0)
    return v.unsqueeze(-4).squeeze(1).sum(dim=(0, 1, 2, 3)), v


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_kernel_with_only_empty_outputs_is_not_generated(backend):
    from tests.helpers import explain_strict

    x = torch.randn(5, 17, 8, 0).transpose(-1, -2)
    line = repro(program="softmax_of_an_empty_tensor", inputs=[x], backend=backend)
    report = explain_strict(_softmax_of_an_empty_tensor, x, backend=backend)
    skipped = [k for k in report.kernels if k.source.startswith("(not generated")]
    assert skipped, f"{report}\n{line}"
    host = "\n".join(g.host_source for g in report.graphs)
    assert all(f"# {k.name}: every output is empty" in host for k in skipped), host
    got = torch.compile(_softmax_of_an_empty_tensor, backend="ember", options={"backend": backend, "strict": True})(x)
    for k, (g, e) in enumerate(zip(got, _softmax_of_an_empty_tensor(x))):
        assert_close(g, e, rtol=0, atol=0, what=f"output {k}", line=line)
