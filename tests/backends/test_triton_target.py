"""A GPU's Triton target (backend, arch, warp size), which the Target and every kernel key name, is computed
from torch's compute capability as Triton's CUDA driver computes it, without making that driver (which
builds C helpers with the host compiler on a fresh machine); elsewhere it is the driver's answer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton.runtime

from ember.backends.triton_target import gpu_arch


class _NoDriver:
    @property
    def active(self):
        raise AssertionError("Triton's driver was made")


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), (10, 0), (12, 0)])
def test_an_nvidia_gpu_s_target_is_triton_s_own_without_its_driver(monkeypatch, capability):
    from triton.backends.nvidia.driver import CudaDriver

    asked = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    monkeypatch.setattr(triton.runtime, "driver", _NoDriver())
    fake = SimpleNamespace(get_current_device=lambda: 0, get_device_capability=lambda device: capability)
    theirs = CudaDriver.get_current_target(fake)
    assert (
        gpu_arch()
        == (theirs.backend, theirs.arch, theirs.warp_size)
        == ("cuda", capability[0] * 10 + capability[1], 32)
    )
    assert gpu_arch(3)[1] == theirs.arch and asked == [0, 3]  # the graph's device where one is named


def test_without_cuda_the_target_is_the_driver_s(monkeypatch):
    target = SimpleNamespace(backend="hip", arch="gfx942", warp_size=64)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(
        triton.runtime, "driver", SimpleNamespace(active=SimpleNamespace(get_current_target=lambda: target))
    )
    assert gpu_arch() == ("hip", "gfx942", 64)


def test_the_interpreter_runs_kernels_with_their_compile_options():
    """Under Triton's interpreter a kernel runs as ember compiles it for a GPU (KERNEL_OPTIONS): without the
    interpreter's own 32-bit overflow check (its builder's options read back after a graph is built), and an
    int32 product that wraps in eager wraps in the kernel too."""
    from triton.runtime import interpreter

    from ember.backends.compile_workers import KERNEL_OPTIONS
    from tests.helpers import ember_compile

    x = torch.tensor([2**30, -(2**31), 7, 3], dtype=torch.int32)
    got = ember_compile(lambda i: i * 4 + i, "triton")(x)
    torch.testing.assert_close(got, x * 4 + x)
    options = interpreter.interpreter_builder.options
    assert all(getattr(options, k) == v for k, v in KERNEL_OPTIONS.items()), options
