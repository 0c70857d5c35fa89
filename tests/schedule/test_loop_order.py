"""Loops walk memory in order, and inference batch norm is one pointwise kernel.

A channels-last activation [N, C, H, W] has strides (HWC, 1, WC, C): walking it in logical
order puts stride C on the innermost loop (uncoalesced on a GPU, no SIMD on a CPU). The
scheduler orders each kernel's loops by the strides of the biggest buffer it writes.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from tests.helpers import assert_close, explain_strict, repro

N, C, H, W = 2, 16, 5, 6


def _conv_bn_relu(train: bool, memory_format):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(8, C, 3, padding=1), torch.nn.BatchNorm2d(C), torch.nn.ReLU())
    m.train(train)
    with torch.no_grad():
        m[1].running_mean.normal_()
        m[1].running_var.uniform_(0.5, 2.0)
    return m.to(memory_format=memory_format)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_inference_batch_norm_fuses_with_relu_in_memory_order(memory_format):
    m = _conv_bn_relu(False, memory_format)
    x = torch.randn(N, 8, H, W).contiguous(memory_format=memory_format)
    with torch.no_grad():
        report = explain_strict(copy.deepcopy(m), x)
        got = torch.compile(copy.deepcopy(m), backend="ember")(x)
        want = m(x)
    line = repro(memory_format=str(memory_format))
    assert_close(got, want, rtol=1e-5, atol=1e-5, what="conv-bn-relu", line=line)
    assert got.stride() == want.stride(), line
    (kernel,) = report.kernels  # batch norm + ReLU after the convolution extern
    bounds = [int(b) for b in re.findall(r"for \(int64_t l\d+ = 0; l\d+ < (\d+);", kernel.source)]
    innermost = C if memory_format == torch.channels_last else H * W
    assert bounds[-1] == innermost, kernel.source


def test_activation_between_convolutions_keeps_channels_last():
    """The BN + ReLU output feeding the next convolution is written channels-last, as eager lays
    it out: else its kernel transposes and the convolution converts it back."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(8, C, 3, padding=1), torch.nn.BatchNorm2d(C), torch.nn.ReLU(), torch.nn.Conv2d(C, C, 1)
    ).eval()
    m = m.to(memory_format=torch.channels_last)
    x = torch.randn(N, 8, H, W).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        report = explain_strict(copy.deepcopy(m), x)
        assert_close(torch.compile(m, backend="ember")(x), m(x), rtol=1e-5, atol=1e-5, what="out", line=repro())
    (graph,) = report.graphs
    layout = f"({N}, {C}, {H}, {W}), ({C * H * W}, 1, {W * C}, {C})"
    src = graph.host_source
    # Fresh memory in that layout, or in place of the convolution's result, which has it.
    in_place = re.search(r"_fix_layout\(\w+_\d+\(", src) and f"{layout})" in src and "# in place" in src
    assert f"empty({layout}" in src or in_place, src


def test_training_batch_norm_matches_eager_channels_last():
    m = _conv_bn_relu(True, torch.channels_last)
    ref = copy.deepcopy(m)
    x = torch.randn(N, 8, H, W).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    got = torch.compile(m, backend="ember")(x)
    want = ref(xr)
    line = repro(case="train channels_last")
    assert_close(got, want, rtol=1e-4, atol=1e-5, what="output", line=line)
    got.square().sum().backward()
    want.square().sum().backward()
    assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4, what="input grad", line=line)
    assert_close(m[0].weight.grad, ref[0].weight.grad, rtol=1e-4, atol=1e-4, what="conv weight grad", line=line)
    assert_close(m[1].weight.grad, ref[1].weight.grad, rtol=1e-4, atol=1e-4, what="bn weight grad", line=line)
    assert_close(m[1].running_mean, ref[1].running_mean, rtol=1e-5, atol=1e-6, what="running mean", line=line)
    assert_close(m[1].running_var, ref[1].running_var, rtol=1e-5, atol=1e-6, what="running var", line=line)
