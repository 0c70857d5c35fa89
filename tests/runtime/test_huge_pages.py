"""Large CPU buffers are advised to use transparent huge pages before their first write; small ones,
and every buffer with the setting off, take the plain allocator."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

import ember
from ember.runtime import huge_pages
from tests.helpers import ember_compile, explain_strict


def _pointwise3(x):
    return torch.relu(x) * 0.5 + 1


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, start, length, advice):
        self.calls.append((start, length, advice))
        return 0


def _vm_flags(address: int) -> list[str]:
    """The kernel's flags of the mapping that holds `address` (/proc/self/smaps: `hg` is
    MADV_HUGEPAGE advice)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(tmp_path) == "madvise"
    (tmp_path / "enabled").write_text("[always] madvise never\n")
    assert huge_pages.thp_mode(tmp_path) == "always"
    assert huge_pages.thp_mode(tmp_path / "absent") == "unsupported"


def test_advice_covers_only_whole_aligned_pages_inside_the_buffer():
    recorder, page = _Recorder(), 2 << 20
    t = torch.empty(huge_pages.MIN_BYTES // 4 + 1000)
    huge_pages.advise(t, recorder, page)
    ((start, length, advice),) = recorder.calls
    base, end = t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()
    assert advice == 14 and start % page == 0 and length % page == 0
    assert base <= start < base + page and end - page < start + length <= end
    huge_pages.advise(torch.empty(huge_pages.MIN_BYTES // 4 - 1), recorder, page)  # below the threshold: no advice
    assert len(recorder.calls) == 1


def test_compiled_program_advises_its_large_buffers_and_matches_eager():
    """Where the kernel's THP mode is madvise, the 32 MiB output's aligned interior carries the
    advice (its mapping's `hg` flag); elsewhere advice cannot help and the plain allocator is used."""
    x = torch.randn(4096, 2048)  # the output is exactly MIN_BYTES
    report = explain_strict(_pointwise3, x)
    (graph,) = report.graphs
    fn = ember_compile(_pointwise3, "cpp")
    out = fn(x)
    torch.testing.assert_close(out, _pointwise3(x))
    page = huge_pages._huge_page_bytes()
    interior = -(-out.data_ptr() // page) * page
    if huge_pages.thp_mode() != "madvise":
        assert "empty_huge" not in graph.host_source, huge_pages.thp_mode()
        return
    assert "empty_huge((4096, 2048)" in graph.host_source
    assert "hg" in _vm_flags(interior), "the 32 MiB output was not advised"
    # A fresh mapping of the same size is not advised: the flag comes from the advice. (Not torch.empty's: the
    # allocator may hand out memory an earlier advised buffer of this process left behind.)
    plain = mmap.mmap(-1, 4096 * 2048 * 4)
    plain.write(b"\1" * len(plain))
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(plain))
        assert "hg" not in _vm_flags(-(-address // page) * page)
    finally:
        plain.close()


def test_small_buffers_and_the_setting_off_take_the_plain_allocator():
    (small,) = explain_strict(_pointwise3, torch.randn(64, 64)).graphs
    assert "empty((64, 64)" in small.host_source and "empty_huge" not in small.host_source
    with ember.config.override(cpu_huge_pages=False):
        (off,) = explain_strict(_pointwise3, torch.randn(4096, 2048)).graphs
    assert "empty_huge" not in off.host_source
