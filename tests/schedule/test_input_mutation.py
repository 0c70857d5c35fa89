"""Graph inputs the graph writes (AOTAutograd's in-graph input mutations): batch norm's running
statistics in training and a user's in-place update of an argument. The new value goes straight
into the input when the kernel computing it is the input's last user (memory plan), else one copy
at the end of the host program; either way the caller's tensor ends equal to eager's (on both code
generators, and with Triton on a GPU where one is present)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.helpers import ON_DEVICES, assert_close, assert_no_fallback, assert_not_worse, ember_compile, reports


@pytest.mark.parametrize("backend,device", ON_DEVICES)
def test_batch_norm_running_statistics_written_in_place(backend, device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.BatchNorm2d(8))
    model = model.to(device).train()
    reference = copy.deepcopy(model)
    compiled = ember_compile(model, backend)
    line = f"repro: conv + 2 BatchNorm2d training, 3 steps, {backend} on {device}"
    with reports() as report:  # the first step compiles
        for _ in range(3):
            x = torch.randn(4, 3, 8, 8, device=device)
            compiled(x).sum().backward()
            reference(x).sum().backward()
    assert_no_fallback(report, line)
    for (name, got), (_, want) in zip(model.named_buffers(), reference.named_buffers()):
        assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6, what=name, line=line)
    assert int(model[1].num_batches_tracked) == 3
    (forward,) = [g for g in report.graphs if g.kind == "forward"]
    # Two running means, two running variances and two batch counters: each written by the kernel
    # that computes it, with no copy after the graph (AOTAutograd's or ember's).
    assert "6 mutated inputs written in place" in forward.memory, forward.memory
    assert ".copy_(" not in forward.host_source, forward.host_source


@pytest.mark.parametrize("backend,device", ON_DEVICES)
def test_batch_norm_running_statistics_under_bf16_autocast_channels_last(backend, device):
    """Under bf16 autocast the activations are bf16 and the running statistics stay float32: each
    kernel still writes its statistic into the buffer, and buffers and gradients are no further
    from a float32 run's than eager's (under the same autocast) are."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.BatchNorm2d(8))
    model = model.to(device, memory_format=torch.channels_last).train()
    eager, fp32 = copy.deepcopy(model), copy.deepcopy(model)
    compiled = ember_compile(model, backend)
    line = f"repro: conv + 2 BatchNorm2d training under bf16 autocast, channels_last, 2 steps, {backend} on {device}"
    # A random cotangent: sum(bn(x)) would give a zero gradient upstream (batch norm removes the mean).
    cotangent = torch.randn(4, 8, 8, 8, device=device)
    with reports() as report:
        for _ in range(2):
            x = torch.randn(4, 3, 8, 8, device=device).contiguous(memory_format=torch.channels_last)
            with torch.autocast(device, torch.bfloat16):
                (compiled(x).float() * cotangent).sum().backward()
                (eager(x).float() * cotangent).sum().backward()
            (fp32(x) * cotangent).sum().backward()
    assert_no_fallback(report, line)
    named = zip(model.named_buffers(), eager.buffers(), fp32.buffers())
    for (name, got), want, ref in named:
        assert got.dtype == want.dtype, f"{name}: {got.dtype} != {want.dtype}\n{line}"
        if got.is_floating_point():
            assert_not_worse(got, want, ref, what=name, line=line)
        else:
            assert torch.equal(got, want), f"{name}: {got} != {want}\n{line}"
    for (name, got), want, ref in zip(model.named_parameters(), eager.parameters(), fp32.parameters()):
        assert_not_worse(got.grad, want.grad, ref.grad, what=f"{name}.grad", line=line)
    (forward,) = [g for g in report.graphs if g.kind == "forward"]
    assert "6 mutated inputs written in place" in forward.memory, forward.memory


def _accumulate(x, acc):
    acc.add_(x * 2)  # read and written by one kernel, element for element: in place
    return x.sin()


def _overwrite_with_an_input(x, buf):
    old = buf * 3  # the old value is read, and the new one is another input: a copy at the end
    buf.copy_(x)
    return old + 1


def _old_value_read_later(x, buf):
    buf.mul_(2)  # the new value is also returned: kept in its own buffer, copied in at the end
    return buf, x.sum() * buf


@pytest.mark.parametrize("backend,device", ON_DEVICES)
@pytest.mark.parametrize("fn", [_accumulate, _overwrite_with_an_input, _old_value_read_later], ids=lambda f: f.__name__)
def test_user_input_mutation(backend, device, fn):
    x = torch.randn(5, 6, device=device)
    buf = torch.randn(5, 6, device=device)
    buf_ref = buf.clone()
    line = f"repro: {fn.__name__} on randn(5, 6), {backend} on {device}"
    with reports() as report:
        got = ember_compile(fn, backend)(x, buf)
    want = fn(x, buf_ref)
    assert_no_fallback(report, line)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert_close(a, b, rtol=1e-5, atol=1e-6, what="output", line=line)
    assert_close(buf, buf_ref, rtol=1e-5, atol=1e-6, what="mutated input", line=line)
    (graph,) = report.graphs
    in_place = "mutated inputs written in place" in graph.memory
    assert in_place == (fn is _accumulate), f"{graph.memory}\n{graph.host_source}\n{line}"
