"""A CUDA convolution's bias peeled off into a pointwise add that ember fuses into the next kernel, and
in a backward its gradient summed by ember rather than by convolution_backward.
Graphs are traced over fake CUDA tensors (no GPU needed), rewritten, then run on real CPU tensors
against eager: the rewritten graph names no device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ember.frontend.conv_bias import peel_bias, sum_bias_gradients

aten = torch.ops.aten


def _traced_on_cuda(fn, *inputs):
    """`fn` traced to ATen over fake CUDA copies of `inputs`, each node carrying its fake value."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") for t in inputs]
        return make_fx(fn)(*fakes)


def _convolutions(gm):
    return [n for n in gm.graph.nodes if n.target is aten.convolution.default]


def _read_twice(y):
    return y.relu() + y.sigmoid()


CASES = {
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1), [(2, 8, 10, 10), (16, 8, 3, 3), (16,)]),
    "depthwise 7x7": (lambda x, w, b: F.conv2d(x, w, b, padding=3, groups=8), [(2, 8, 14, 14), (8, 1, 7, 7), (8,)]),
    "conv3d": (lambda x, w, b: F.conv3d(x, w, b), [(1, 4, 5, 6, 7), (6, 4, 3, 3, 3), (6,)]),
    "transposed": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), [(2, 8, 5, 5), (8, 4, 3, 3), (4,)]),
    "transposed, groups": (
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, groups=2),
        [(2, 8, 5, 5), (8, 3, 3, 3), (6,)],
    ),
    "read twice": (
        lambda x, w, b: _read_twice(F.conv2d(x, w, b)),
        [(1, 3, 8, 8), (5, 3, 3, 3), (5,)],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bias_peeled_and_result_unchanged(name):
    fn, shapes = CASES[name]
    torch.manual_seed(0)
    inputs = [torch.randn(s) for s in shapes]
    gm = _traced_on_cuda(fn, *inputs)
    assert peel_bias(gm) == 1
    (conv,) = _convolutions(gm)
    assert conv.args[2] is None
    (add,) = [u for u in conv.users]
    assert add.target is aten.add.Tensor and add.meta["val"].device.type == "cuda"
    torch.testing.assert_close(gm(*inputs), fn(*inputs), rtol=1e-5, atol=1e-5)


def test_channels_last_result_keeps_its_layout():
    x = torch.randn(2, 8, 10, 10).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(8, 1, 3, 3), torch.randn(8)
    gm = _traced_on_cuda(lambda x, w, b: F.conv2d(x, w, b, groups=8), x, w, b)
    before = [n.meta["val"].stride() for n in _convolutions(gm)]
    peel_bias(gm)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0]
    result = result[0] if isinstance(result, (list, tuple)) else result
    assert result.target is aten.add.Tensor
    assert result.meta["val"].stride() == before[0]  # what AOTAutograd was promised


def test_left_alone_without_a_bias_or_off_the_gpu():
    x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
    gm = _traced_on_cuda(lambda x, w: F.conv2d(x, w), x, w)
    assert peel_bias(gm) == 0
    cpu = make_fx(lambda x, w, b: F.conv2d(x, w, b), tracing_mode="fake")(x, w, torch.randn(4))
    assert peel_bias(cpu) == 0 and _convolutions(cpu)[0].args[2] is not None


def test_a_bias_of_another_dtype_is_left_alone():
    """`aten.convolution` called directly with a float32 bias on half inputs: the add would promote the
    result, so the convolution stays whole."""
    x, w, b = torch.randn(1, 3, 8, 8).half(), torch.randn(4, 3, 3, 3).half(), torch.randn(4)

    def conv(x, w, b):
        return aten.convolution.default(x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)

    try:
        gm = _traced_on_cuda(conv, x, w, b)
    except RuntimeError:
        pytest.skip("this torch refuses the mixed dtypes while tracing")
    assert peel_bias(gm) == 0


def test_the_backend_hook_rewrites_cuda_graphs_only():
    from ember.frontend.backend import _conv_bias_epilogue

    x, w, b = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(t.shape, device="cuda") for t in (x, w, b)]
    gm = _traced_on_cuda(lambda x, w, b: F.conv2d(x, w, b), x, w, b)
    _conv_bias_epilogue(gm, fakes, "forward")
    assert _convolutions(gm)[0].args[2] is None
    cpu = make_fx(lambda x, w, b: F.conv2d(x, w, b), tracing_mode="fake")(x, w, b)
    _conv_bias_epilogue(cpu, [x, w, b], "forward")
    assert _convolutions(cpu)[0].args[2] is not None


def _backward(stride, padding, groups, transposed, mask=(True, True, True)):
    def fn(grad, x, w):
        channels = w.shape[1] * groups if transposed else w.shape[0]
        output_padding = [0] * (x.dim() - 2)
        return aten.convolution_backward.default(
            grad, x, w, [channels], stride, padding, [1] * (x.dim() - 2), transposed, output_padding, groups, list(mask)
        )

    return fn


BACKWARD_CASES = {
    # name: (x, w, stride, padding, groups, transposed)
    "conv2d": ((2, 8, 10, 10), (16, 8, 3, 3), [1, 1], [1, 1], 1, False),
    "depthwise 7x7": ((2, 8, 14, 14), (8, 1, 7, 7), [1, 1], [3, 3], 8, False),
    "conv3d": ((1, 4, 5, 6, 7), (6, 4, 3, 3, 3), [1, 1, 1], [0, 0, 0], 1, False),
    "conv1d, stride 2": ((2, 8, 30), (16, 8, 3), [2], [1], 1, False),
    "transposed, groups": ((2, 8, 5, 5), (8, 3, 3, 3), [2, 2], [0, 0], 2, True),
}


@pytest.mark.parametrize("name", list(BACKWARD_CASES))
def test_bias_gradient_summed_and_gradients_unchanged(name):
    x_shape, w_shape, stride, padding, groups, transposed = BACKWARD_CASES[name]
    torch.manual_seed(0)
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    out = (
        F.conv_transpose2d(x, w, stride=stride, groups=groups)
        if transposed
        else {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[x.dim()](x, w, stride=stride, padding=padding, groups=groups)
    )
    grad = torch.randn(out.shape)
    fn = _backward(stride, padding, groups, transposed)
    gm = _traced_on_cuda(fn, grad, x, w)
    assert sum_bias_gradients(gm) == 1
    (conv,) = [n for n in gm.graph.nodes if n.target is aten.convolution_backward.default]
    assert list(conv.args[-1]) == [True, True, False]
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert len(sums) == 1 and sums[0].args[0].op == "placeholder"
    for got, want in zip(gm(grad, x, w), fn(grad, x, w)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bias_gradient_left_alone_where_not_asked_or_off_the_gpu():
    x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
    grad = torch.randn(1, 4, 6, 6)
    no_bias = _backward([1, 1], [0, 0], 1, False, mask=(True, True, False))
    assert sum_bias_gradients(_traced_on_cuda(no_bias, grad, x, w)) == 0
    cpu = make_fx(_backward([1, 1], [0, 0], 1, False), tracing_mode="fake")(grad, x, w)
    assert sum_bias_gradients(cpu) == 0
