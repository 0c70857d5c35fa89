"""Which product a frozen linear layer runs on the CPU (backends/cpu_products.py): oneDNN's over a packed
weight where it measured faster than ATen's at the layer's shape on this machine; the times are kept in the
disk cache, read back instead of measured again, and measured anew where an entry is damaged."""

from __future__ import annotations

import pytest
import torch

from ember import config
from ember.backends import cpu_products


class Times:
    """A stand-in for the timing: returns `times`, counting its calls."""

    def __init__(self, packed_us: float, aten_us: float):
        self.times, self.calls = {"packed_us": packed_us, "aten_us": aten_us}, 0

    def __call__(self, rows, k, n, bias) -> dict:
        self.calls += 1
        return dict(self.times)


def _never(rows, k, n, bias) -> dict:
    raise AssertionError("measured again: the stored times were not read")


def test_measured_times_are_stored_per_shape_and_read_back(tmp_path):
    with config.override(cache_dir=str(tmp_path)):
        first = Times(80.0, 100.0)
        assert cpu_products.measured_times(32, 256, 4096, False, first) == first.times
        assert cpu_products.measured_times(32, 256, 4096, False, _never) == first.times
        other = Times(120.0, 100.0)  # another shape (here: with a bias) is measured for itself
        assert cpu_products.measured_times(32, 256, 4096, True, other) == other.times
        assert first.calls == 1 and other.calls == 1


def test_a_damaged_entry_is_measured_again(tmp_path):
    with config.override(cache_dir=str(tmp_path)):
        cpu_products.measured_times(8, 16, 32, False, Times(1.0, 2.0))
        (entry,) = (tmp_path / "device").glob("*/*")
        (entry / cpu_products.RESULT_FILE).write_bytes(b'{"packed_us": -1, "aten_us": "fast"}')
        again = Times(3.0, 4.0)
        assert cpu_products.measured_times(8, 16, 32, False, again) == again.times and again.calls == 1


@pytest.mark.parametrize("packed_us,aten_us,packs", [(90.0, 100.0, True), (96.0, 100.0, False), (150.0, 100.0, False)])
def test_packing_needs_a_clear_win(tmp_path, monkeypatch, packed_us, aten_us, packs):
    """A tie keeps ATen's product (and the model's own weight, not a packed second copy of it)."""
    monkeypatch.setattr(cpu_products, "_measure", Times(packed_us, aten_us))
    with config.override(cache_dir=str(tmp_path)):
        assert cpu_products.packed_is_faster(16, 64, 64, True) is packs


@pytest.mark.skipif(not hasattr(torch.ops.mkldnn, "_linear_pointwise"), reason="this torch has no oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_the_timing_runs_both_products(bias):
    times = cpu_products._measure(4, 32, 48, bias)
    assert set(times) == {"packed_us", "aten_us"} and all(0 < t < 1e5 for t in times.values()), times


def test_the_timing_leaves_the_callers_random_stream_alone():
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    cpu_products._measure(4, 8, 8, False)
    assert torch.equal(torch.rand(3), want)
