"""Each CUDA SDPA call's backward gets its output gradient in the output's layout (frontend/sdpa_gradient.py).

The rewrite runs on CUDA graphs only; these tests run it on CPU graphs (rewrite_sdpa_calls directly,
and end to end with the graph's device taken for CUDA) to check which calls change, the layout the
attention backward receives, and that the results are eager's."""

import pytest
import torch
import torch.nn.functional as F

from ember import config
from ember.frontend import sdpa_gradient
from ember.frontend.sdpa_gradient import rewrite_sdpa_calls, sdpa_gradient_pass, sdpa_output_layout_gradient


def _capture(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def _three_calls(q, k, v, mask):
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    b = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    c = F.scaled_dot_product_attention(q, k, v, None, 0.0)
    return a, b, c


def _targets(gm):
    sdpa = (F.scaled_dot_product_attention, sdpa_output_layout_gradient)
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in sdpa]


def test_every_sdpa_call_is_rewritten_and_computes_the_same():
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    mask = torch.rand(16, 16) > 0.5
    gm, inputs = _capture(_three_calls, q, k, v, mask)
    assert rewrite_sdpa_calls(gm) == 3
    assert _targets(gm) == [sdpa_output_layout_gradient] * 3
    for got, expected in zip(gm(*inputs), _three_calls(q, k, v, mask)):
        torch.testing.assert_close(got, expected)


def test_cpu_graphs_are_left_alone():
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    gm, inputs = _capture(_three_calls, q, k, v, torch.rand(16, 16) > 0.5)
    assert sdpa_gradient_pass(gm, inputs) == 0
    assert _targets(gm) == [F.scaled_dot_product_attention] * 3


@pytest.mark.parametrize("heads_transposed", [True, False])
def test_the_attention_backward_receives_the_gradient_in_the_outputs_layout(heads_transposed):
    q, k, v = (torch.randn(2, 16, 3, 8) for _ in range(3))
    if heads_transposed:  # views of [batch, tokens, heads, size], as models make them
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    else:
        q, k, v = (t.reshape(2, 3, 16, 8) for t in (q, k, v))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    seen = []
    out = sdpa_output_layout_gradient(q, k, v, is_causal=True)
    out.grad_fn.next_functions[0][0].register_prehook(lambda grads: seen.append(grads[0].stride()))
    for grad in (torch.randn(2, 3, 16, 8), torch.randn(2, 16, 3, 8).transpose(1, 2)):
        got = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        expected = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
    assert seen == [out.stride(), out.stride()]


def test_without_gradients_nothing_is_added():
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    out = sdpa_output_layout_gradient(q, k, v, is_causal=True)
    assert out.grad_fn is None
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.out = torch.nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(2, 16, 32)).sum() + y.sum()


def test_a_compiled_training_step_through_the_rewrite_matches_eager(monkeypatch):
    """AOTAutograd traces the rewritten call, forward and backward (the graph taken for a CUDA one)."""
    traced = []

    def counting(*args, **kwargs):
        traced.append(1)
        return sdpa_output_layout_gradient(*args, **kwargs)

    monkeypatch.setattr(sdpa_gradient, "sdpa_output_layout_gradient", counting)
    monkeypatch.setattr(sdpa_gradient, "_on_cuda", lambda gm, inputs: True)
    torch.manual_seed(0)
    model = _Block()
    x = torch.randn(2, 16, 32)
    expected = torch.autograd.grad(model(x), list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ember")
    got = torch.autograd.grad(compiled(x), list(model.parameters()))
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert traced, "the rewritten call was not traced"


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _heads(kind: str, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Query, key and value of [2, 4 heads, 32 tokens, 16] laid out as a model makes them."""
    g = torch.Generator(device=device).manual_seed(0)
    if kind == "contiguous":
        return [torch.randn(2, 4, 32, 16, device=device, dtype=dtype, generator=g) for _ in range(3)]
    if kind == "transposed":  # [batch, tokens, heads, size] with the heads moved forward
        return [torch.randn(2, 32, 4, 16, device=device, dtype=dtype, generator=g).transpose(1, 2) for _ in range(3)]
    fused = torch.randn(2, 32, 3, 4, 16, device=device, dtype=dtype, generator=g)  # one q/k/v projection
    return list(fused.permute(2, 0, 3, 1, 4).unbind(0))


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused"])
@pytest.mark.parametrize("merged", [False, True], ids=["output", "heads-merged"])
def test_gradients_through_compiled_sdpa_meet_the_float64_rule(device, layout, merged, monkeypatch):
    """A compiled step's query, key and value gradients, in each layout a model gives them and with the
    output used as it is or transposed back and merged (so the gradient arrives in either layout):
    on a GPU, cuDNN's attention backward under the rewrite; on the CPU, the rewrite forced onto the
    CPU graph (its copy traced where the layouts differ)."""
    monkeypatch.setattr(sdpa_gradient, "_on_cuda", lambda gm, inputs: True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def attend(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(2, 32, 64) if merged else out * 1.0

    def grads(fn, tensors, cast=None):
        leaves = [(t.to(cast) if cast else t).detach().requires_grad_(True) for t in tensors]
        out = fn(*leaves)
        weight = torch.linspace(-1, 1, out.numel(), device=device, dtype=out.dtype).view_as(out)
        return torch.autograd.grad((out * weight).sum(), leaves)

    heads = _heads(layout, device, dtype)
    reference = grads(attend, heads, torch.float64)
    eager = grads(attend, heads)
    torch._dynamo.reset()
    compiled = grads(torch.compile(attend, backend="ember"), heads)
    for r, e, c in zip(reference, eager, compiled):
        eager_error = (e.double() - r).abs().max().item()
        error = (c.double() - r).abs().max().item()
        assert error <= 2 * eager_error + 1e-5, f"{layout}: error {error:.3g} against eager's {eager_error:.3g}"


def _checkpointed(q, k, v):
    from torch.utils.checkpoint import checkpoint

    out = checkpoint(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v, use_reentrant=False
    )
    return out.transpose(1, 2).reshape(2, 32, 64)


def test_an_activation_checkpointed_call_is_rewritten_and_trains_as_eager(monkeypatch):
    monkeypatch.setattr(sdpa_gradient, "_on_cuda", lambda gm, inputs: True)
    heads = _heads("transposed", "cpu", torch.float32)
    gm, _ = _capture(_checkpointed, *heads)
    assert rewrite_sdpa_calls(gm) == 1
    leaves = [t.detach().requires_grad_(True) for t in heads]
    expected = torch.autograd.grad(_checkpointed(*leaves).sum(), leaves)
    torch._dynamo.reset()
    with config.override(strict=True):  # a fallback raises
        got = torch.autograd.grad(torch.compile(_checkpointed, backend="ember")(*leaves).sum(), leaves)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
