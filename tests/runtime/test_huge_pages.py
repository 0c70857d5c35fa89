"""Large CPU buffers are advised to use transparent huge pages before their first write; small ones,
and every buffer with the setting off, take the plain allocator."""

from __future__ import annotations

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


def _record_advice(monkeypatch) -> _Recorder:
    recorder = _Recorder()
    monkeypatch.setattr(huge_pages, "_madvise", lambda: recorder)
    monkeypatch.setattr(huge_pages, "_huge_page_bytes", lambda: 2 << 20)
    return recorder


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(tmp_path) == "madvise"
    (tmp_path / "enabled").write_text("[always] madvise never\n")
    assert huge_pages.thp_mode(tmp_path) == "always"
    assert huge_pages.thp_mode(tmp_path / "absent") == "unsupported"


def test_advice_covers_only_whole_aligned_pages_inside_the_buffer(monkeypatch):
    recorder = _record_advice(monkeypatch)
    page = 2 << 20
    t = torch.empty(huge_pages.MIN_BYTES // 4 + 1000)
    huge_pages.advise(t)
    ((start, length, advice),) = recorder.calls
    base, end = t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()
    assert advice == 14 and start % page == 0 and length % page == 0
    assert base <= start < base + page and end - page < start + length <= end
    huge_pages.advise(torch.empty(huge_pages.MIN_BYTES // 4 - 1))  # below the threshold: no advice
    assert len(recorder.calls) == 1


def test_compiled_program_advises_its_large_buffers_and_matches_eager(monkeypatch):
    recorder = _record_advice(monkeypatch)
    x = torch.randn(4096, 2048)  # the output is exactly MIN_BYTES
    report = explain_strict(_pointwise3, x)
    (graph,) = report.graphs
    assert "empty_huge((4096, 2048)" in graph.host_source
    fn = ember_compile(_pointwise3, "cpp")
    torch.testing.assert_close(fn(x), _pointwise3(x))
    assert recorder.calls, "the 32 MiB output was not advised"


def test_small_buffers_and_the_setting_off_take_the_plain_allocator(monkeypatch):
    _record_advice(monkeypatch)
    (small,) = explain_strict(_pointwise3, torch.randn(64, 64)).graphs
    assert "empty((64, 64)" in small.host_source and "empty_huge" not in small.host_source
    with ember.config.override(cpu_huge_pages=False):
        (off,) = explain_strict(_pointwise3, torch.randn(4096, 2048)).graphs
    assert "empty_huge" not in off.host_source
