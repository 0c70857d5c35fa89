"""Depthwise convolutions as sums over their window's views (aten/lowerings/convolution.py), where the target
takes them (`lower.depthwise_convolutions`: the C++ target's default) and freezing has laid the weight out
with its channels innermost (frontend/prepack.py): against eager, with padding, stride, dilation, bias,
TensorFlow-style explicit pads and 5x5 windows, in both layouts; computed by a kernel, not a library call;
left to the library where the weight is row-major (no freezing) or the target leaves them. Through Triton's
interpreter too, with the heuristic turned on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import assert_close, assert_no_fallback, ember_compile, randomize_bn, reports, repro

TOL = {"rtol": 1e-4, "atol": 1e-4}


class DepthwiseBlock(nn.Module):
    """(explicit zero pad) -> depthwise conv -> batch norm -> ReLU6, as MobileNetV2 writes it."""

    def __init__(self, channels, k=3, stride=1, padding=1, dilation=1, bias=False, pad=None):
        super().__init__()
        self.pad = pad
        self.conv = nn.Conv2d(channels, channels, k, stride, padding, dilation, groups=channels, bias=bias)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        if self.pad is not None:
            x = nn.functional.pad(x, self.pad)
        return nn.functional.relu6(self.bn(self.conv(x)))


# name -> (block arguments, input shape, channels-last)
CASES = {
    "3x3": ({"channels": 8}, (2, 8, 9, 9), False),
    "3x3-stride2-channels-last": ({"channels": 16, "stride": 2}, (1, 16, 12, 12), True),
    "5x5-bias": ({"channels": 8, "k": 5, "padding": 2, "bias": True}, (1, 8, 10, 10), True),
    "dilated": ({"channels": 4, "padding": 2, "dilation": 2}, (1, 4, 9, 9), False),
    "tf-padded-stride2": ({"channels": 8, "stride": 2, "padding": 0, "pad": (0, 1, 0, 1)}, (1, 8, 10, 10), True),
    "no-padding": ({"channels": 6, "padding": 0}, (1, 6, 7, 7), True),
    # padding="valid" reaches ATen as one value for both dims (HF EfficientNet's stride-2 depthwise convolutions)
    "valid-stride2": ({"channels": 8, "stride": 2, "padding": "valid", "pad": (1, 2, 1, 2)}, (1, 8, 11, 11), True),
    "per-dim-3x1": ({"channels": 8, "k": (3, 1), "stride": (1, 2), "padding": (1, 0)}, (1, 8, 9, 8), True),
    "1x1-one-channel": ({"channels": 1, "k": 1, "padding": 0, "bias": True}, (2, 1, 5, 5), False),
}


def _run(name, backend="cpp", **options):
    kwargs, shape, channels_last = CASES[name]
    torch._dynamo.reset()
    model = randomize_bn(DepthwiseBlock(**kwargs)).eval()
    x = torch.randn(shape)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    with torch.no_grad(), reports() as report:
        expected = model(x)
        actual = ember_compile(model, backend, **options)(x)
    line = repro(case=name, backend=backend, **options)
    assert_no_fallback(report, line)
    assert_close(actual, expected, **TOL, what=name, line=line)
    assert actual.stride() == expected.stride(), f"strides {actual.stride()} vs eager's {expected.stride()}\n{line}"
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    return graph, line


@pytest.mark.parametrize("name", CASES)
def test_frozen_depthwise_convolution_is_a_kernel_and_matches_eager(name):
    graph, line = _run(name, freezing=True)
    assert not [e for e in graph.externs if "convolution" in e], f"{graph.externs}\n{line}"
    assert any("convolution" in k.ops for k in graph.kernels), f"{[k.ops for k in graph.kernels]}\n{line}"


def test_a_row_major_weight_leaves_the_convolution_to_the_library():
    """Without freezing the weight is the parameter itself, row-major: read along the kernel's channels it
    would be gathered, so the lowering declines."""
    graph, line = _run("3x3")
    assert [e for e in graph.externs if "convolution" in e], f"{graph.externs}\n{line}"


def test_the_target_may_leave_depthwise_convolutions_to_the_library():
    graph, line = _run("3x3-stride2-channels-last", freezing=True, heuristics="lower.depthwise_convolutions=0")
    assert [e for e in graph.externs if "convolution" in e], f"{graph.externs}\n{line}"


@pytest.mark.parametrize("name", ["3x3-stride2-channels-last", "tf-padded-stride2"])
def test_triton_computes_them_where_the_heuristic_says(name):
    graph, line = _run(name, backend="triton", freezing=True, heuristics="lower.depthwise_convolutions=1")
    assert not [e for e in graph.externs if "convolution" in e], f"{graph.externs}\n{line}"
