"""Graphs that call SDPA and need gradients are traced without cuDNN's attention on CUDA
(frontend/attention_backward.py). On the CPU the graphs are taken for CUDA ones (`_on_cuda`), and
each compile records the flag AOTAutograd's trace saw; the flag is the caller's again afterwards."""

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.frontend import attention_backward
from tests.helpers import assert_no_fallback, reports


def _attend(q):
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()


def _mlp(x):
    return torch.relu(x @ x.T).sum()


@pytest.fixture
def traced_flags(monkeypatch):
    """The cuDNN-attention flag when ember compiles each graph (the forward's compile runs inside
    AOTAutograd's trace), with every graph taken for a CUDA one."""
    import ember.pipeline

    seen = []
    compile_graph = ember.pipeline.compile_graph

    def spy(gm, example_inputs, kind, **kwargs):
        seen.append((kind, torch._C._get_cudnn_sdp_enabled()))
        return compile_graph(gm, example_inputs, kind, **kwargs)

    monkeypatch.setattr(ember.pipeline, "compile_graph", spy)
    monkeypatch.setattr(attention_backward, "_on_cuda", lambda node: True)
    return seen


def _compile_and_run(fn, x, **options):
    torch._dynamo.reset()
    with ember.config.override(strict=True, aot_cache=False, **options):
        out = torch.compile(fn, backend="ember")(x)
        if out.requires_grad:
            out.backward()
    return out


def test_a_training_graph_calling_sdpa_is_traced_without_cudnn(traced_flags):
    before = torch._C._get_cudnn_sdp_enabled()
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    out = _compile_and_run(_attend, q)
    expected_grad = torch.autograd.grad(_attend(q), q)[0]
    torch.testing.assert_close(out, _attend(q))
    torch.testing.assert_close(q.grad, expected_grad)
    assert ("forward", False) in traced_flags, traced_flags
    assert torch._C._get_cudnn_sdp_enabled() == before


@pytest.mark.parametrize(
    "fn, grad, options",
    [(_attend, False, {}), (_attend, True, {"sdpa_cudnn_training": True}), (_mlp, True, {})],
    ids=["inference", "setting-on", "no-sdpa"],
)
def test_other_graphs_keep_the_callers_kernels(traced_flags, fn, grad, options):
    x = torch.randn(2, 2, 8, 4, requires_grad=grad) if fn is _attend else torch.randn(8, 8, requires_grad=grad)
    _compile_and_run(fn, x, **options)
    assert traced_flags and all(enabled for _, enabled in traced_flags), traced_flags


def _attend_with_grad_enabled(q):
    with torch.enable_grad():
        return _attend(q)


def test_grad_enabled_inside_a_no_grad_call_counts_as_training(traced_flags):
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    with torch.no_grad():
        _compile_and_run(_attend_with_grad_enabled, q)
    assert ("forward", False) in traced_flags, traced_flags


def test_a_graph_ember_runs_eagerly_runs_without_cudnn(monkeypatch):
    """Dynamo's graph in ember's place (here: AOTAutograd's trace fails) runs under the exclusion."""

    def failing(*args, **kwargs):
        raise RuntimeError("trace failed")

    flags = []
    real = attention_backward.eager_without_cudnn_attention

    def recording(run):
        wrapped = real(run)

        def call(*args):
            flags.append("called")
            return wrapped(*args)

        return call

    def flag_at_sdpa(*args, **kwargs):
        flags.append(torch._C._get_cudnn_sdp_enabled())
        return F.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(attention_backward, "_on_cuda", lambda node: True)
    monkeypatch.setattr(attention_backward, "eager_without_cudnn_attention", recording)
    monkeypatch.setattr("torch._dynamo.backends.common.aot_autograd", lambda **kw: failing)
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(_attend, backend="ember")
    with pytest.warns(UserWarning, match="running a graph eagerly"):
        out = compiled(q)
    torch.testing.assert_close(out, _attend(q))
    assert flags == ["called"], flags
    with attention_backward._cudnn_attention_off():
        flag_at_sdpa(q, q, q)
    assert flags[-1] is False and torch._C._get_cudnn_sdp_enabled()


def test_the_flag_comes_back_after_an_error_and_a_lone_math_kernel_warns(monkeypatch):
    monkeypatch.setattr(attention_backward, "_on_cuda", lambda node: True)
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    gm = torch.fx.symbolic_trace(_attend)
    before = torch._C._get_cudnn_sdp_enabled()
    only = [torch.nn.attention.SDPBackend.CUDNN_ATTENTION, torch.nn.attention.SDPBackend.MATH]
    seen = []

    def trace_that_fails():
        with attention_backward.training_attention_kernels(attention_backward.excludes_cudnn(gm, [q])):
            seen.append(torch._C._get_cudnn_sdp_enabled())
            raise RuntimeError("boom")

    with torch.nn.attention.sdpa_kernel(only), pytest.raises(RuntimeError, match="boom"):  # noqa: SIM117
        with pytest.warns(UserWarning, match="math kernel"):
            trace_that_fails()
    assert seen == [False]
    assert torch._C._get_cudnn_sdp_enabled() == before


def test_a_backward_graph_calling_cudnn_attention_warns():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default, (x,))
    graph.output(node)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with pytest.warns(UserWarning, match="cuDNN's attention backward"):
        attention_backward.check_traced(gm, "backward")
    attention_backward.check_traced(gm, "forward")  # a forward graph: nothing to say


def test_a_cpu_graph_keeps_the_callers_kernels():
    gm = torch.fx.symbolic_trace(_attend)
    for node in gm.graph.nodes:  # as Dynamo records it: the query's example value
        if node.op == "placeholder":
            node.meta["example_value"] = torch.randn(2, 2, 8, 4)
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    assert not attention_backward.excludes_cudnn(gm, [q])


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _heads(kind: str, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Query, key and value of [2, 4 heads, 32 tokens, 16] laid out as models make them."""
    g = torch.Generator(device=device).manual_seed(0)
    if kind == "contiguous":
        return [torch.randn(2, 4, 32, 16, device=device, dtype=dtype, generator=g) for _ in range(3)]
    if kind == "transposed":  # [batch, tokens, heads, size] with the heads moved forward
        return [torch.randn(2, 32, 4, 16, device=device, dtype=dtype, generator=g).transpose(1, 2) for _ in range(3)]
    fused = torch.randn(2, 32, 3, 4, 16, device=device, dtype=dtype, generator=g)  # one q/k/v projection
    return list(fused.permute(2, 0, 3, 1, 4).unbind(0))


def _gradients(fn, tensors, cast=None):
    leaves = [(t.to(cast) if cast else t).detach().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    weight = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    return torch.autograd.grad((out * weight).sum(), leaves)


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused"])
def test_compiled_attention_gradients_meet_the_float64_rule_whatever_ran_before(device, layout):
    """Eager backwards of the same shapes with the output gradient in both layouts run first (on a
    GPU they build cuDNN's cached plans), then the compiled step, with the output used as it is and
    transposed back and merged: every gradient within twice the error of eager's math kernel against float64."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def as_is(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 1.0

    def merged(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 32, 64)

    heads = _heads(layout, device, dtype)
    for fn in (merged, as_is):  # eager first, in both gradient layouts
        _gradients(fn, heads)
    for fn in (as_is, merged):
        reference = _gradients(fn, heads, torch.float64)
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            eager = _gradients(fn, heads)  # no cached plans: the error a correct kernel has
        torch._dynamo.reset()
        with reports() as report, ember.config.override(strict=True):
            compiled = _gradients(torch.compile(fn, backend="ember"), heads)
        assert_no_fallback(report, f"{fn.__name__} {layout} {device}")
        for r, e, c in zip(reference, eager, compiled):
            eager_error = (e.double() - r).abs().max().item()
            error = (c.double() - r).abs().max().item()
            assert error <= 2 * eager_error + 1e-3, f"{fn.__name__}: {error:.3g} against eager's {eager_error:.3g}"
