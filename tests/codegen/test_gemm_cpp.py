"""ember's C++ GEMM template (codegen/gemm_cpp.py, chosen by backends/cpp.py): float32 products of static
sizes as ember's own kernels, their epilogues fused. Each case against eager, at sizes that reach the
template's edges: rows not a multiple of the 6-row tile, columns not a multiple of the 16-column panel
(and fewer than 16), one thread and several, a panel of B on the stack and on the heap (K above 1024), B
read transposed. Then what the schedule holds, and where ATen keeps a product, with its reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.backends.cpp import CppBackend, choose_gemm
from ember.schedule.gemm import GemmProblem
from tests.helpers import (
    assert_close,
    assert_no_fallback,
    compiled_graph,
    ember_compile,
    forward_backward,
    fresh_inputs,
    reports,
    repro,
)


def _linear_relu(x, w, b):
    return torch.relu(F.linear(x, w, b))


def _linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def _residual_scale(x, w, r):
    return (x @ w) * 0.5 + r


def _linear_3d_residual(x, w, b, r):
    return F.linear(x, w, b) + r  # [B, T, C]: a 2-D product whose epilogue runs over a reshape


def _a_view(big, w):
    return big[3:40, 8:40] @ w


def _r(*shape):
    return torch.randn(*shape, generator=_GEN)


_GEN = torch.Generator().manual_seed(0)

# name, function, inputs
CASES = [
    ("mm_one_thread", torch.mm, lambda: [_r(33, 17), _r(17, 29)]),  # M*N*K below the threads' threshold
    ("mm_threads", torch.mm, lambda: [_r(70, 64), _r(64, 50)]),  # 12 row tiles, 4 panels (the last of 2 columns)
    ("mm_few_columns", torch.mm, lambda: [_r(130, 128), _r(128, 5)]),  # one panel: rows cut into bands
    ("a_view_with_offset", _a_view, lambda: [_r(50, 48), _r(32, 24)]),  # A's rows 48 apart, from element 152
    ("linear_relu", _linear_relu, lambda: [_r(50, 40), _r(37, 40), _r(37)]),  # B transposed, bias by column
    ("linear_gelu", _linear_gelu, lambda: [_r(33, 24), _r(40, 24), _r(40)]),
    ("residual_scale", _residual_scale, lambda: [_r(20, 36), _r(36, 24), _r(20, 24)]),
    ("linear_3d_residual", _linear_3d_residual, lambda: [_r(2, 9, 24), _r(16, 24), _r(16), _r(2, 9, 16)]),
    ("long_k_heap_panel", torch.mm, lambda: [_r(13, 1100), _r(1100, 21)]),  # a 16 x 1100 panel: on the heap
]


@pytest.mark.parametrize("name,fn,make", CASES, ids=[c[0] for c in CASES])
def test_template_matches_eager_forward_and_backward(name, fn, make):
    base = make()
    line = repro(case=name, inputs=base)
    with reports() as report:
        compiled = ember_compile(fn, "cpp")
        outs, grads = forward_backward(compiled, [], fresh_inputs(base), grad_seed=1, train=True)
    assert_no_fallback(report, line)
    (forward,) = [g for g in report.graphs if g.kind == "forward"]
    assert not [e for e in forward.externs if "mm" in e], (
        f"{name}: the forward's product ran on ATen\n{forward}\n{line}"
    )
    assert any("C++ GEMM template" in f.reason for f in forward.fusion), f"{forward}\n{line}"
    want_outs, want_grads = forward_backward(fn, [], fresh_inputs(base), grad_seed=1, train=True)
    for got, want in zip(outs + grads, want_outs + want_grads):
        assert_close(got, want, rtol=1e-4, atol=1e-4, what=name, line=line)


def test_the_epilogue_joins_the_template():
    """linear + bias + ReLU: one kernel that reads x, w and the bias and writes the result once."""
    m, k, n = 50, 40, 37
    x, w, b = _r(m, k), _r(n, k), _r(n)
    with torch.no_grad():
        out, graph = compiled_graph(_linear_relu, [x, w, b], backend="cpp")
    line = repro(case="linear_relu")
    assert_close(out, _linear_relu(x, w, b), rtol=1e-5, atol=1e-5, what="out", line=line)
    assert not graph.externs, f"{graph}\n{line}"
    (kernel,) = graph.kernels
    assert "relu" in kernel.ops, f"{graph}\n{line}"
    assert graph.bytes == 4 * (m * k + k * n + n + m * n), f"{graph.bytes}\n{graph}\n{line}"
    fused = [f for f in graph.fusion if f.accepted and "epilogue fused into the GEMM template" in f.reason]
    assert len(fused) == 1, f"{graph}\n{line}"


def test_frozen_linear_layers_run_as_the_template_and_see_a_written_weight():
    """Under freezing the products read the frozen (transposed) weights; a weight written in place is
    seen at the next call, as everywhere under freezing."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 10)).eval()
    x = _r(7, 24)
    compiled = ember_compile(model, "cpp", freezing=True)
    with torch.no_grad(), reports() as report:
        for what, change in (("first call", lambda: None), ("weight written", lambda: model[0].weight.mul_(-1))):
            change()
            assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5, what=what, line=repro(change=what))
    assert_no_fallback(report, repro())
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    assert not graph.externs and "mkldnn" not in graph.aten_graph, f"{graph}\n{graph.aten_graph}"


def _problem(**changes) -> GemmProblem:
    fields = {
        "batch": 1,
        "m": 128,
        "n": 256,
        "k": 256,
        "dtype": torch.float32,
        "a_layout": "row",
        "b_layout": "col",
        "device": "cpu",
    }
    return GemmProblem(**{**fields, **changes})


@pytest.mark.parametrize(
    "changes,reason",
    [
        ({"dtype": torch.bfloat16}, "the C++ template computes float32"),
        ({"batch": 4}, "a batched product"),
        ({"static": False}, "sizes known only at run time"),
        ({"a_layout": "col"}, "A's layout col"),
        ({"k": 8192}, "K 8192 > cpp.gemm_max_k"),
        ({"m": 1 << 20}, "> cpp.gemm_max_a_bytes"),
    ],
)
def test_products_outside_the_template_stay_aten_and_say_why(changes, reason):
    h = CppBackend().target().heuristics.cpp
    choice = choose_gemm(h, _problem(**changes), 0)
    assert not choice.template and reason in choice.reason, choice
    assert choose_gemm(h, _problem(), 0).template


def test_the_heuristic_off_and_dynamic_sizes_keep_blas():
    x, w = _r(40, 24), _r(24, 30)
    with torch.no_grad():
        out, graph = compiled_graph(torch.mm, [x, w], backend="cpp", heuristics="cpp.gemm_template=0")
    assert graph.externs == ["mm"] and "cpp.gemm_template is off" in str(graph.fusion), str(graph)
    assert_close(out, x @ w, rtol=1e-5, atol=1e-5, what="off", line=repro(heuristics="cpp.gemm_template=0"))
    with reports() as report, torch.no_grad():
        compiled = ember_compile(torch.mm, "cpp", dynamic=True)
        for rows in (40, 57):
            x = _r(rows, 24)
            assert_close(compiled(x, w), x @ w, rtol=1e-5, atol=1e-5, what=f"{rows} rows", line=repro(dynamic=True))
    assert_no_fallback(report, repro(dynamic=True))
    assert any("sizes known only at run time" in f.reason for g in report.graphs for f in g.fusion), report.graphs


def _reads_its_operand(x, w):
    u = x * 2
    return u + u @ w  # the epilogue reads A element by element at A's last use


def _diamond(x, w):
    a = torch.relu(x)
    return a * 3 + a @ w


def _updates_its_operand(x, w):
    x.add_(x @ w)  # a mutated input, read as A


def _updates_its_weight(x, w):
    w.add_(x @ w)  # ... read as B (x square), in two row bands: one panel of 16 columns, 130 rows


@pytest.mark.parametrize(
    "fn,make",
    [
        (_reads_its_operand, lambda: [_r(64, 64), _r(64, 64)]),
        (_diamond, lambda: [_r(48, 64), _r(64, 64)]),
        (_updates_its_operand, lambda: [_r(64, 64), _r(64, 64)]),
        (_updates_its_weight, lambda: [_r(130, 130), _r(130, 16)]),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_no_output_is_written_over_an_operand(fn, make):
    """An epilogue that reads A (or B) element by element at its last use, or writes a mutated input that is
    A or B, takes memory of its own: the template's other tiles still read the operand's rows and columns."""
    base = make()
    line = repro(fn=fn.__name__, inputs=base)
    mine, theirs = [x.clone() for x in base], [x.clone() for x in base]
    torch._dynamo.reset()
    with torch.no_grad(), reports() as report:
        got = ember_compile(fn, "cpp")(*mine)
        want = fn(*theirs)
    assert_no_fallback(report, line)
    (graph,) = report.graphs
    assert not graph.externs and " 0 in place" in graph.memory, f"{graph.memory}\n{graph.host_source}\n{line}"
    for a, b in zip([got, *mine] if got is not None else mine, [want, *theirs] if want is not None else theirs):
        assert_close(a, b, rtol=1e-4, atol=1e-4, what=fn.__name__, line=line)


def test_nan_and_inf_propagate_and_a_batched_product_stays_aten():
    x, w = _r(20, 32), _r(32, 24)
    x[3, 5], w[7, 2] = float("nan"), float("inf")
    with torch.no_grad():
        out, graph = compiled_graph(torch.mm, [x, w], backend="cpp")
    assert not graph.externs, str(graph)
    assert torch.equal(out.isnan(), (x @ w).isnan()) and torch.equal(out.isinf(), (x @ w).isinf())
    finite = (x @ w).isfinite()
    assert_close(out[finite], (x @ w)[finite], rtol=1e-5, atol=1e-5, what="finite", line=repro(case="nan_inf"))
    a, b = _r(1, 8, 16), _r(1, 16, 8)
    with torch.no_grad():
        out, graph = compiled_graph(torch.bmm, [a, b], backend="cpp")
    assert graph.externs == ["bmm"] and "a batched product" in str(graph.fusion), str(graph)
    assert_close(out, torch.bmm(a, b), rtol=1e-5, atol=1e-5, what="bmm", line=repro(case="bmm of batch 1"))
