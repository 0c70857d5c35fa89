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
    assert kernel.fn.__name__ == "twice_attribute"
    assert module.loaded


def test_a_kernel_stand_in_keeps_its_function_and_refuses_what_is_not_the_kernel_s(tmp_path, monkeypatch):
    import copy

    import pytest

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = _module(tmp_path, monkeypatch, KERNEL.replace("twice", "twice_stand_in"))
    with pytest.raises(KeyError, match="no function twice_missing"):
        module.function("twice_missing")  # a name the source lacks: said when the graph is built
    kernel = module.function("twice_stand_in")
    with pytest.raises(AttributeError):
        kernel.__wrapped__  # noqa: B018 - a probe's dunder imports nothing
    assert not module.loaded
    assert copy.copy(kernel).name == "twice_stand_in" and not module.loaded
    first = kernel.resolve()
    assert kernel.resolve() is first and kernel._function is first  # one lookup, then the function kept


def test_a_warm_build_whose_kernels_launch_from_records_imports_and_keys_nothing(tmp_path, monkeypatch):
    """TritonBackend.build on the GPU path (as on a GPU whose launch records are all in the cache): every
    kernel's static launch comes from its record, so the module is only written to the cache, never
    imported, and no kernel is keyed for deduplication."""
    import dataclasses

    from ember.backends import kernel_dedup, static_launch
    from ember.backends import triton as triton_backend
    from ember.backends.kernel_module import KernelFunction
    from tests.schedule.test_fusion import G

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    b = G()
    x = b.input(64, 48)
    y = b.pw("exp", b.pw("mul", x, x))
    kernels = b.schedule(b.reduce("sum", y, (1,), keepdim=True), b.pw("neg", x)).kernels
    backend = triton_backend.TritonBackend()
    backend._target = dataclasses.replace(backend._target, interpreted=False)  # as on a GPU

    class Records:
        def __init__(self, module_key, jobs, target):
            self.names = [j[0] for j in jobs]

        def load(self):
            return {name: {"name": name} for name in self.names}

        def save(self, records):
            raise AssertionError("nothing was compiled: nothing to save")

    def from_record(record, device):
        return static_launch.StaticLaunch(lambda *a: None, 1, 4, 0, (), 0, record)

    keyed = []
    monkeypatch.setattr(triton_backend, "LaunchRecords", Records)
    monkeypatch.setattr(static_launch, "from_record", from_record)
    monkeypatch.setattr(triton_backend, "_device_index", lambda device: 0)
    monkeypatch.setattr(triton_backend, "_current_device", lambda: 0)
    monkeypatch.setattr(kernel_dedup, "kernel_key", lambda *a: keyed.append(a) or "key")
    before = stats.snapshot()
    namespace = backend.build(kernels, None)
    assert kernels and set(backend.static) == {k.name for k in kernels}
    assert stats.delta(before).get("kernel_modules_imported", 0) == 0 and not keyed
    assert all(isinstance(namespace[k.name], KernelFunction) for k in kernels)  # the kernel[grid] paths, deferred


def test_threads_that_use_a_kernel_at_once_import_its_module_once(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = _module(tmp_path, monkeypatch, KERNEL.replace("twice", "twice_threads"))
    before = stats.snapshot()
    with ThreadPoolExecutor(8) as pool:  # as GEMM templates compile, each thread reading its function
        found = list(pool.map(lambda _: module.function("twice_threads").resolve(), range(16)))
    assert all(f is found[0] for f in found) and stats.delta(before)["kernel_modules_imported"] == 1
