"""max_pool2d lowers to a chain over the window's strided views (aten/lowerings/pooling.py): values and
indices equal eager's exactly (NaN, -inf and padding included), its backward to a gather over
the windows holding each input position, whose gradients match eager's (on both code generators,
and with Triton on a GPU where one is present), and inference writes no index tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import (
    BACKENDS,
    ON_DEVICES,
    assert_no_fallback,
    cpp_innermost_loop_vectorized,
    ember_compile,
    explain_strict,
    reports,
    repro,
)

# (input shape, kernel, stride, padding, ceil_mode, channels_last)
CASES = {
    "resnet_stem": ((2, 3, 9, 9), 3, 2, 1, False, True),
    "k2s2": ((2, 3, 8, 7), 2, 2, 0, False, False),
    "ceil_mode": ((1, 2, 7, 7), 3, 2, 1, True, False),
    "unbatched_rect": ((3, 10, 11), (3, 2), (1, 2), (1, 0), False, False),
    "stride_1": ((1, 2, 5, 6), 3, 1, 1, False, True),
    # The backward's candidate windows: a kernel smaller than its stride (positions no window
    # holds), and ceil_mode's partial last window without padding.
    "k2s3p1": ((2, 3, 10, 9), 2, 3, 1, False, True),
    "ceil_no_padding": ((1, 2, 8, 7), 3, 2, 0, True, False),
}


def _input(shape, channels_last):
    x = torch.randn(shape)
    x[0, ..., 1, 1] = float("nan")  # NaN wins its windows; its index is the last NaN's
    x[..., 2, :] = float("-inf")  # a window of -inf only keeps its first in-range index
    x[..., -1, -2] = x[..., -1, -1]  # ties keep the first
    return x.to(memory_format=torch.channels_last) if channels_last else x


@pytest.mark.parametrize("backend,device", ON_DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_values_indices_and_gradient_equal_eager(backend, device, name):
    shape, k, s, p, ceil, channels_last = CASES[name]
    x = _input(shape, channels_last).to(device)  # keeps channels_last

    def pool(t):
        return F.max_pool2d(t, k, s, p, ceil_mode=ceil, return_indices=True)

    # A random upstream gradient: a candidate that picks the wrong output row or column shows.
    weight = torch.randn(pool(x)[0].shape, generator=torch.Generator().manual_seed(1)).to(device)

    def loss(t):
        return pool(t)[0].nan_to_num(0.0, 5.0, -5.0).mul(weight).sum()

    line = repro(case=name, backend=backend, device=device, inputs=[x])
    with reports() as report:
        values, indices = ember_compile(pool, backend)(x)
        xg = x.clone().requires_grad_()
        ember_compile(loss, backend)(xg).backward()
    assert_no_fallback(report, line)
    want_values, want_indices = pool(x)
    assert torch.equal(indices, want_indices), f"indices differ\n{line}"
    torch.testing.assert_close(values, want_values, rtol=0, atol=0, equal_nan=True, msg=line)
    xe = x.clone().requires_grad_()
    loss(xe).backward()
    torch.testing.assert_close(xg.grad, xe.grad, rtol=1e-6, atol=1e-6, msg=line)
    # Forward and backward lowered, not ATen: the backward is a gather over the output windows.
    externs = [e for g in report.graphs for e in g.externs]
    assert not any("max_pool" in str(e) for e in externs), f"{externs}\n{line}"


def _stem():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1)
    ).eval()


def test_inference_writes_no_indices_triton():
    """conv -> batch norm -> ReLU -> max pool, as ResNet's stem, on Triton: one kernel reads the
    convolution's output once (batch norm and ReLU are recomputed per window element from cache,
    never stored) and writes only the pooled values (eager's kernel also writes the int64 indices:
    4x the values' bytes in bf16)."""
    model, x = _stem(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        (graph,) = explain_strict(model, x, backend="triton", channels_last=False).graphs
    assert len(graph.kernels) == 1 and graph.externs == ["convolution"], graph
    (pool,) = graph.kernels
    assert "max_pool2d_with_indices" in pool.ops and "relu" in pool.ops, graph
    conv_out, pooled, bn_params = 2 * 8 * 16 * 16 * 4, 2 * 8 * 8 * 8 * 4, 4 * 8 * 4
    assert conv_out + pooled <= pool.bytes <= conv_out + pooled + bn_params, graph


def test_inference_pools_a_stored_activation_in_cpp():
    """The same stem in C++: the activation is computed once and stored, and the pool reads it (each of
    the nine window terms recomputing it through stride-2 loads that do not vectorize took 8.8 ms of
    ResNet's step on 2 cores, against 2.6 ms); no indices are written either."""
    model, x = _stem(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        # (row-major: channels-last adds the kernel converting the input, frontend/layout.py)
        (graph,) = explain_strict(model, x, channels_last=False).graphs
    assert len(graph.kernels) == 2 and graph.externs == ["convolution"], graph
    act, pool = graph.kernels
    assert "relu" in act.ops and "max_pool2d_with_indices" in pool.ops, graph
    conv_out, pooled = 2 * 8 * 16 * 16 * 4, 2 * 8 * 8 * 8 * 4
    assert pool.bytes <= conv_out + pooled, graph  # the stored activation and the pooled values, no indices
    with torch.no_grad():
        torch.testing.assert_close(ember_compile(model, "cpp")(x), model(x), rtol=1e-5, atol=1e-5)


def test_channels_last_pool_vectorizes_over_channels_in_cpp():
    """ResNet's stem pool over a channels-last activation: the kernel's vector loop walks channels, and
    each window position's "inside the image" test is a value that loop does not change. GCC 12 turned
    such selects (and `std::min` clamps) into branches and left the loop scalar: 4.3 ms of ResNet-18's
    call on 2 cores, 0.16 ms for Inductor's."""

    def stem_pool(x):
        return F.max_pool2d(torch.relu(x), 3, 2, 1)

    x = torch.randn(1, 64, 16, 16).to(memory_format=torch.channels_last)
    with torch.no_grad():
        (graph,) = explain_strict(stem_pool, x).graphs
        pool = next(k for k in graph.kernels if "max_pool2d_with_indices" in k.ops)
        assert cpp_innermost_loop_vectorized(pool.source), pool.source
        torch.testing.assert_close(ember_compile(stem_pool, "cpp")(x), stem_pool(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ceil_mode_reads_stay_inside_the_input(backend):
    """ceil_mode's partial last window reaches past x when there is no padding: its value is
    masked, and its load must not leave x either. x is placed to end right at an inaccessible
    page, so a read past its end crashes the process (the C++ kernel once read 6 elements past
    it)."""
    import ctypes
    import mmap

    shape = (1, 2, 8, 7)

    def pool(t):
        return F.max_pool2d(t, 3, 2, 0, ceil_mode=True)

    x0 = torch.randn(shape)
    compiled = ember_compile(pool, backend)
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    buffer = (ctypes.c_char * (2 * page)).from_buffer(region)
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(ctypes.addressof(buffer) + page, page, 0) == 0  # PROT_NONE
    x = torch.frombuffer(buffer, dtype=torch.float32, count=x0.numel(), offset=page - 4 * x0.numel())
    x.copy_(x0.reshape(-1))
    torch.testing.assert_close(compiled(x.view(shape)), pool(x0), rtol=0, atol=0, msg=repro(backend=backend))
    libc.mprotect(ctypes.addressof(buffer) + page, page, 3)  # PROT_READ | PROT_WRITE, for unmapping
