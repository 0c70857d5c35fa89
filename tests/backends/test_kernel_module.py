"""A graph's Triton kernel module (backends/kernel_module.py) is written to ember's cache at once and
imported only when a kernel's function is used: a warm start whose kernels all launch from their
launch records never runs `@triton.jit` over them. Run through Triton's interpreter."""

from __future__ import annotations

import sys

import torch

from ember import stats
from ember.backends.kernel_module import KernelModule
from ember.codegen.triton import PRELUDE

KERNEL = """@triton.jit
def twice(in_v0, out_v1, xnumel, XBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    tmp1 = tl.load(in_v0 + xindex, xindex < xnumel, other=0)
    tl.store(out_v1 + xindex, tmp1 * 2.0, xindex < xnumel)
"""


def _module(tmp_path, monkeypatch, text: str) -> KernelModule:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    return KernelModule(PRELUDE + "\n\n" + text)


def test_the_module_is_cached_at_once_and_imported_at_the_first_use_of_a_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    text = KERNEL.replace("twice", "twice_first_use")  # a module no other test imported
    before = stats.snapshot()
    module = _module(tmp_path, monkeypatch, text)
    kernel = module.function("twice_first_use")
    assert not module.seen and not module.loaded
    assert f"ember_kernels_{module.key[:16]}" not in sys.modules
    assert stats.delta(before).get("kernel_modules_imported", 0) == 0
    assert "not imported" in repr(kernel)

    x = torch.arange(10, dtype=torch.float32)
    out = torch.empty_like(x)
    kernel[(1,)](x, out, 10, XBLOCK=16)  # kernel[grid]: what a host program's slow path calls
    assert module.loaded and stats.delta(before)["kernel_modules_imported"] == 1
    assert torch.equal(out, x * 2)
    assert kernel.resolve() is module.load().twice_first_use  # one import per process
    assert stats.delta(before)["kernel_modules_imported"] == 1

    again = _module(tmp_path, monkeypatch, text)  # a later graph with the same source: a cache hit
    assert again.seen and again.key == module.key


def test_reading_a_kernel_s_attribute_imports_the_module(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = _module(tmp_path, monkeypatch, KERNEL.replace("twice", "twice_attribute"))
    kernel = module.function("twice_attribute")
    assert not module.loaded
    assert kernel.__name__ == "twice_attribute"
    assert module.loaded
