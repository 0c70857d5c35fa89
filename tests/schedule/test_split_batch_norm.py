"""Batch norm's statistics in training are reductions over (N, H, W) into C outputs: split along
the batch (schedule/split.py) so the first stage has N times more outputs, and still equal to
eager forward, backward and in the running statistics."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from tests.helpers import BACKENDS, assert_close, assert_no_fallback, ember_compile, reports

N, C, H, W = 8, 16, 32, 16  # H*W*N = 4096 elements per channel: the shortest the split takes (min_reduce)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C), nn.ReLU()).train()


def _outer_size(domain: str) -> int:
    """Outputs of a kernel domain such as '[8, r1, 16, r32, r32]': the product of its non-r dims."""
    dims = re.findall(r"(r?)(\d+)", domain)
    size = 1
    for r, n in dims:
        size *= 1 if r else int(n)
    return size


def _size(domain: str) -> int:
    size = 1
    for _, n in re.findall(r"(r?)(\d+)", domain):
        size *= int(n)
    return size


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "contiguous"])
@pytest.mark.parametrize("second_split", [1, 8], ids=["batch", "batch_and_h"])
def test_batch_norm_training_splits_its_statistics(backend, channels_last, second_split):
    # The target's split.max_second_split is off (1) by default; with 8, a GPU splits H as well
    # (_rewrite_two_dims). A heuristic enters the schedule's key, so the cache stays on.
    heuristics = f"split.max_second_split={second_split}"
    model = _model()
    reference = copy.deepcopy(model)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model, reference = model.to(memory_format=fmt), reference.to(memory_format=fmt)
    x = torch.randn(N, C, H, W).contiguous(memory_format=fmt)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    line = f"repro: conv + BatchNorm2d + ReLU training, {backend}, [{N}, {C}, {H}, {W}] channels_last={channels_last}"
    with reports() as report:
        y = ember_compile(model, backend, heuristics=heuristics)(xa)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
    want = reference(xb)
    want.backward(torch.linspace(-1, 1, want.numel()).reshape(want.shape))
    assert_no_fallback(report, line)
    assert_close(y, want, rtol=1e-4, atol=1e-4, what="output", line=line)
    assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-4, what="input grad", line=line)
    assert_close(model[0].weight.grad, reference[0].weight.grad, rtol=1e-4, atol=1e-3, what="conv grad", line=line)
    assert_close(model[1].weight.grad, reference[1].weight.grad, rtol=1e-4, atol=1e-3, what="bn grad", line=line)
    assert_close(model[1].running_var, reference[1].running_var, rtol=1e-5, atol=1e-6, what="running var", line=line)
    # Every reduction over the whole activation (its H and W reduced) runs with N partial results
    # per channel, not C rows of N*H*W. On a GPU a channels-last activation of few channels
    # (N * C <= 32 columns per program x 132 SMs) splits H too: N * (H-blocks) per channel.
    stages = [k for g in report.graphs for k in g.kernels if "r" in k.domain and _size(k.domain) == N * C * H * W]
    assert stages, f"no reduction over the activation?\n{report.graphs}\n{line}"
    for k in stages:
        outer = _outer_size(k.domain)
        if backend == "triton" and channels_last and second_split > 1:
            assert outer > N * C and outer % (N * C) == 0, f"{k.name} over {k.domain}\n{line}"
        else:
            assert outer == N * C, f"{k.name} over {k.domain}\n{report.graphs}\n{line}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_statistics_read_x_once(backend):
    # var_mean over a split: each chunk's sum and its shifted sums in one pass (schedule/split.py:
    # _rewrite_variance), then Chan's combination. The forward reads the activation twice in all:
    # the statistics, then the normalization.
    model = _model()
    x = torch.randn(N, C, H, W).contiguous(memory_format=torch.channels_last)
    line = f"repro: conv + BatchNorm2d + ReLU training forward, {backend}, [{N}, {C}, {H}, {W}] channels_last"
    with reports() as report:
        ember_compile(model.to(memory_format=torch.channels_last), backend)(x)
    assert_no_fallback(report, line)
    (forward,) = [g for g in report.graphs if g.kind == "forward"]
    over_x = [k for k in forward.kernels if _size(k.domain) == N * C * H * W]
    assert len(over_x) == 2, f"{[(k.name, k.domain, k.ops) for k in forward.kernels]}\n{line}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [0.0, 1e3, 1e5, 1e7])
def test_split_variance_is_accurate_far_from_zero(backend, offset):
    # The shifted, chunked variance against float64 of the same float32 values, for data whose mean
    # is far from 0 (where sum(x^2) - n * mean^2 in float32 would lose every digit, and the chunks'
    # means minus the mean would lose most): within a few float32 roundings of the variance (~1).
    # The two-pass form it replaces was 9e-5 off at 1e5, 8e-4 at 1e7.
    torch.manual_seed(0)
    x = (torch.randn(N, C, H, W) + offset).contiguous(memory_format=torch.channels_last)
    fn = lambda t: torch.var_mean(t, dim=(0, 2, 3), correction=1)
    line = f"repro: var_mean over (0, 2, 3), {backend}, offset {offset}"
    var, mean = ember_compile(fn, backend)(x)
    want_var, want_mean = (t.float() for t in fn(x.double()))
    assert_close(var, want_var, rtol=1e-6, atol=1e-6, what="variance", line=line)
    assert_close(mean, want_mean, rtol=3e-7, atol=1e-6, what="mean", line=line)  # the mean's own rounding


# Sums of squared differences that are not a variance about the split mean: the rewrite must
# leave them to the two-pass form (rewriting them gives wrong sums).
NOT_A_VARIANCE = {
    # The mean without keepdim broadcasts along the trailing dims, not the ones it reduced.
    "mean_broadcast_elsewhere": lambda x: ((x - x.mean(dim=(0, 2))) ** 2).sum(dim=(0, 2)),
    # The mean of x narrowed to half: the statistics of another tensor.
    "mean_of_a_narrowed_copy": lambda x: ((x - x.half().sum((0, 2), keepdim=True) / 4096) ** 2).sum((0, 2)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(NOT_A_VARIANCE))
def test_sums_that_are_not_a_variance_stay_exact(backend, name):
    torch.manual_seed(0)
    x = torch.randn(64, 64, 64) * 0.01 + torch.arange(64.0)[:, None]
    fn = NOT_A_VARIANCE[name]
    line = f"repro: {name}, {backend}, x [64, 64, 64]"
    got = ember_compile(fn, backend)(x)
    want = fn(x.double()).float()
    assert_close(got, want, rtol=1e-4, atol=1e-3, what=name, line=line)
