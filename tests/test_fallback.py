"""Fail safe, loudly: ops ember cannot lower run as externs; a failing toolchain falls back to
eager for that graph with exactly one warning naming the cause; strict mode raises instead."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ember
from ember.tools.workloads import LayerNormGelu
from tests.helpers import BACKENDS, assert_close, assert_no_fallback, ember_compile, reports, repro

BAD_CXX = "/nonexistent/g++"


def _cumsum_program(x):
    return torch.cumsum(torch.relu(x) * 2, dim=1) + 1


def _sort_values_program(x):
    return torch.sort(x * 2, dim=-1).values.exp() - 1


def _sort_both_program(x):
    values, indices = torch.sort(x.abs() + 1, dim=0)
    return values * 2, indices


EXTERN_PROGRAMS = {
    "cumsum": (_cumsum_program, "cumsum"),
    "sort_values": (_sort_values_program, "sort"),
    "sort_values_and_indices": (_sort_both_program, "sort"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(EXTERN_PROGRAMS))
def test_unlowered_op_runs_as_extern(name, backend):
    """The op ember has no lowering for runs as an ATen call between ember's kernels (strict mode)."""
    fn, extern = EXTERN_PROGRAMS[name]
    x = torch.randn(6, 10)
    line = repro(program=name, backend=backend, dtype=torch.float32, dynamic=False, input=x)
    with reports() as report:
        out = ember_compile(fn, backend)(x)
    expected = fn(x)
    out, expected = (out, expected) if isinstance(out, tuple) else ((out,), (expected,))
    for k, (got, want) in enumerate(zip(out, expected)):
        assert_close(got, want, rtol=1e-5, atol=1e-6, what=f"output {k}", line=line)
    assert_no_fallback(report, line)
    (graph,) = report.graphs
    assert extern in graph.externs, f"expected an extern {extern}:\n{graph}\n{line}"
    assert graph.kernels, f"the ops around the extern should still be compiled:\n{graph}\n{line}"


def _ember_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("ember")]


def test_toolchain_failure_falls_back_with_one_warning(tmp_path):
    fn = _cumsum_program
    x = torch.randn(6, 10)
    line = repro(cxx=BAD_CXX, backend="cpp", strict=False, input=x)
    compiled = torch.compile(fn, backend="ember")
    with warnings.catch_warnings(record=True) as caught, reports() as report:
        warnings.simplefilter("always")
        with ember.config.override(cxx=BAD_CXX, strict=False, backend="cpp", cache_dir=str(tmp_path)):
            outs = [compiled(x) for _ in range(3)]  # compiled once, called three times
    for out in outs:
        assert_close(out, fn(x), rtol=1e-6, atol=1e-6, what="fallback result", line=line)
    ember_msgs = _ember_warnings(caught)
    assert len(ember_msgs) == 1, f"expected exactly one ember warning, got {ember_msgs}\n{line}"
    assert BAD_CXX in ember_msgs[0], f"the warning does not name the cause: {ember_msgs[0]!r}\n{line}"
    assert ember_msgs[0].startswith("ember: running an inference graph eagerly"), ember_msgs[0]
    _assert_names_this_file(caught)
    (graph,) = report.graphs
    assert graph.fallback and BAD_CXX in graph.fallback, f"report.fallback = {graph.fallback!r}\n{line}"
    assert not list(tmp_path.glob("cpp/*/*/graph.so")), f"a failed build left a cache entry\n{line}"


def test_toolchain_failure_in_training_falls_back_per_graph(tmp_path):
    """A forward graph that falls back runs as Dynamo's graph under autograd (eager's own backward): one
    warning, and the backward graph is never compiled; gradients stay correct."""
    model = LayerNormGelu(16)
    x, r = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    line = repro(cxx=BAD_CXX, backend="cpp", strict=False)
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(
        compiled_model, backend="ember", options={"cxx": BAD_CXX, "strict": False, "cache_dir": str(tmp_path)}
    )
    with warnings.catch_warnings(record=True) as caught, reports() as report:
        warnings.simplefilter("always")
        y, h = compiled(x, r)
        grads = torch.autograd.grad((y.sum() + h.sum()), [x, r, *compiled_model.parameters()])
    ye, he = model(x, r)
    expected = torch.autograd.grad((ye.sum() + he.sum()), [x, r, *model.parameters()])
    assert_close(y, ye, rtol=1e-6, atol=1e-6, what="output", line=line)
    for k, (g, e) in enumerate(zip(grads, expected)):
        assert_close(g, e, rtol=1e-5, atol=1e-6, what=f"grad {k}", line=line)
    assert [g.kind for g in report.graphs] == ["forward"], f"{report}\n{line}"
    assert all(g.fallback and BAD_CXX in g.fallback for g in report.graphs), f"{report}\n{line}"
    msgs = _ember_warnings(caught)
    assert len(msgs) == 1 and BAD_CXX in msgs[0], f"expected one warning: {msgs}\n{line}"
    _assert_names_this_file(caught)


def _assert_names_this_file(caught) -> None:
    """A fallback warning names the user's line that ran the compiled function, not ember's."""
    places = [f"{w.filename}:{w.lineno}" for w in caught if str(w.message).startswith("ember")]
    assert places and all(p.startswith(__file__ + ":") for p in places), places


def _causes(e: BaseException) -> list[BaseException]:
    """e and what it wraps (Dynamo wraps backend errors in BackendCompilerFailed)."""
    chain = []
    while e is not None and e not in chain:
        chain.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return chain


def test_toolchain_failure_raises_in_strict_mode(tmp_path):
    x = torch.randn(6, 10)
    settings = ember.config.override(cxx=BAD_CXX, strict=True, backend="cpp", cache_dir=str(tmp_path))
    with settings, warnings.catch_warnings(record=True) as caught, pytest.raises(Exception) as info:
        warnings.simplefilter("always")
        torch.compile(_cumsum_program, backend="ember")(x)
    assert BAD_CXX in str(info.value), str(info.value)
    assert any(type(c).__name__ == "ToolchainError" for c in _causes(info.value)), repr(info.value)
    assert not _ember_warnings(caught), "strict mode raised, it should not also warn"


def test_strict_from_environment(tmp_path, monkeypatch):
    """EMBER_STRICT=1 in the environment has the same effect as config.override(strict=True)."""
    monkeypatch.setenv("EMBER_STRICT", "1")
    monkeypatch.setenv("EMBER_CXX", BAD_CXX)
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    with pytest.raises(Exception) as info:
        torch.compile(_cumsum_program, backend="ember", options={"backend": "cpp"})(torch.randn(6, 10))
    assert BAD_CXX in str(info.value), str(info.value)


def _trace_breaking_table(monkeypatch):
    """A decomposition that raises: AOTAutograd fails to trace before any ember pass runs (as
    PyTorch's own meta of `_efficient_attention_backward` does on torch 2.11, OpInfo on the GPU)."""
    monkeypatch.setenv("EMBER_FAULT_INJECT", "decompose=sin")
    monkeypatch.setenv("EMBER_AOT_CACHE", "0")  # a changed table: AOTAutograd's cache cannot see it


def test_trace_failure_runs_eagerly_with_one_warning(monkeypatch):
    _trace_breaking_table(monkeypatch)
    x = torch.randn(5, requires_grad=True)
    fn = lambda t: torch.sin(t) * 2
    with warnings.catch_warnings(record=True) as caught, reports() as report:
        warnings.simplefilter("always")
        y = torch.compile(fn, backend="ember")(x)
        (g,) = torch.autograd.grad(y.sum(), [x])
    assert_close(y, fn(x), rtol=0, atol=0, what="output", line="")
    assert_close(g, 2 * torch.cos(x), rtol=1e-6, atol=1e-6, what="grad", line="")
    msgs = _ember_warnings(caught)
    assert len(msgs) == 1 and "AOTAutograd: TypeError" in msgs[0], msgs
    _assert_names_this_file(caught)
    (graph,) = report.graphs
    assert graph.fallback.startswith("AOTAutograd: TypeError"), graph.fallback


def test_trace_failure_raises_in_strict_mode(monkeypatch):
    _trace_breaking_table(monkeypatch)
    with ember.config.override(strict=True), pytest.raises(Exception) as info:
        torch.compile(lambda t: torch.sin(t) * 2, backend="ember")(torch.randn(5))
    assert "fault injected at 'decompose'" in str(info.value)


def _clamp_at_mean(x):
    # .item() breaks the graph; the second graph takes the Python float. Called again with another
    # value, Dynamo makes the float an input, AOTAutograd finds that clamp needs it specialized and
    # raises TensorifyScalarRestartAnalysis: Dynamo restarts the capture with it specialized.
    return torch.clamp(x * 2, max=x.mean().item()) + 1


@pytest.mark.parametrize("strict", [False, True])
def test_dynamo_restart_is_not_a_fallback(strict):
    """PyTorch's control-flow exceptions pass through ember, in every mode: the graph compiles."""
    compiled = torch.compile(_clamp_at_mean, backend="ember")
    x = torch.randn(32)
    line = repro(program="clamp(x*2, max=x.mean().item()) + 1", strict=strict, calls="x, then -x")
    with warnings.catch_warnings(record=True) as caught, reports() as report, ember.config.override(strict=strict):
        warnings.simplefilter("always")
        for inp in (x, -x):
            assert_close(compiled(inp), _clamp_at_mean(inp), rtol=1e-6, atol=1e-6, what="output", line=line)
    assert not _ember_warnings(caught), f"{_ember_warnings(caught)}\n{line}"
    assert report.graphs and not [g.fallback for g in report.graphs if g.fallback], f"{report}\n{line}"


def test_triton_backend_without_a_gpu_says_what_it_needs(monkeypatch):
    """On CPU tensors without Triton's interpreter, backend=triton names the way out, not Triton's
    "0 active drivers"; the graph runs eagerly and correctly."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(6, 10)
    settings = ember.config.override(backend="triton", strict=False, aot_cache=False)
    with warnings.catch_warnings(record=True) as caught, settings:
        warnings.simplefilter("always")
        out = torch.compile(_cumsum_program, backend="ember")(x)
    assert_close(out, _cumsum_program(x), rtol=1e-6, atol=1e-6, what="fallback result", line="backend=triton, CPU")
    msgs = _ember_warnings(caught)
    assert len(msgs) == 1, msgs
    msg = msgs[0]
    assert "backend=triton needs a CUDA GPU" in msg and "TRITON_INTERPRET=1" in msg, msg
