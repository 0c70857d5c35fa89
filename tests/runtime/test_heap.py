"""A compiled CPU graph keeps glibc's heap faulted in between calls: freed buffers below 32 MiB are
reused without the kernel faulting and zeroing their pages again. Where the user set glibc's
thresholds, preloaded another allocator, or turned the setting off, malloc is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ember.runtime import heap
from tests.helpers import ember_compile


class _Mallopt:
    def __init__(self):
        self.calls = []

    def __call__(self, param, value):
        self.calls.append((param, value))
        return 1


def test_both_thresholds_fixed():
    mallopt = _Mallopt()
    assert heap.configure(mallopt, 256, {})
    assert mallopt.calls == [(heap._M_MMAP_THRESHOLD, 32 << 20), (heap._M_TRIM_THRESHOLD, 256 << 20)]


@pytest.mark.parametrize(
    "megabytes, environ",
    [
        (0, {}),
        (256, {"MALLOC_TRIM_THRESHOLD_": "1000"}),
        (256, {"MALLOC_MMAP_THRESHOLD_": "1000"}),
        (256, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000"}),
        (256, {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}),
    ],
)
def test_left_alone(megabytes, environ):
    mallopt = _Mallopt()
    assert not heap.configure(mallopt, megabytes, environ)
    assert mallopt.calls == []


def test_other_glibc_tunables_do_not_stop_it():
    mallopt = _Mallopt()
    assert heap.configure(mallopt, 256, {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"})
    assert len(mallopt.calls) == 2


def test_no_glibc():
    assert not heap.configure(None, 256, {})


def test_a_huge_limit_fits_mallopts_int():
    mallopt = _Mallopt()
    heap.configure(mallopt, 1 << 20, {})  # a TiB
    assert mallopt.calls[1] == (heap._M_TRIM_THRESHOLD, 2**31 - 1)


_FAULTS = textwrap.dedent(
    """
    import resource, sys, torch
    from ember.runtime import heap
    from tests.helpers import ember_compile
    mallopt = heap._glibc()
    mallopt(heap._M_MMAP_THRESHOLD, 128 << 10)  # glibc's starting thresholds, held fixed, so that
    mallopt(heap._M_TRIM_THRESHOLD, 128 << 10)  # the process's history cannot change the control
    f = ember_compile(lambda x: (x * 2).sum(), "cpp", cpu_heap_retain_mb=int(sys.argv[1]))
    f(torch.ones(8))
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def call():  # a graph's call: 14 buffers of 1.5 MiB live together, written, then freed together
        buffers = [torch.empty(3 << 17) for _ in range(14)]  # below 2 MiB: no huge page fits in one
        for b in buffers:
            b.fill_(1.0)
    for _ in range(3):  # the first calls fault whatever the setting
        call()
    before = faults()
    for _ in range(10):
        call()
    print(faults() - before)
    """
)


def _faults_of_reused_buffers(megabytes: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, str(megabytes)],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k not in (*heap._USER_SETTINGS, "GLIBC_TUNABLES", "LD_PRELOAD")},
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(heap._glibc() is None, reason="glibc's malloc only")
def test_reused_buffers_do_not_fault_again():
    """Ten calls that each write 21 MiB of buffers and free them: under glibc's starting thresholds every
    buffer is a fresh mmap and each 4 KiB page faults again in the next call (the buffers are below a
    huge page's 2 MiB, so the kernel's THP mode changes nothing); once a CPU graph has been compiled,
    next to none do."""
    kept = _faults_of_reused_buffers(256)
    plain = _faults_of_reused_buffers(0)
    assert plain > 10 * 4000, plain  # the control: 14 x 384 fresh pages every call
    assert kept < plain / 20, (kept, plain)


def test_compiling_a_cpu_graph_sets_it():
    f = ember_compile(lambda x: x + 1, "cpp")
    torch.testing.assert_close(f(torch.ones(3)), torch.full((3,), 2.0))
    assert heap._decided  # decided by the first CPU graph of the process
