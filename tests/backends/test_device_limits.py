"""A device's measured bandwidth is kept in the disk cache (backends/device.py): a later process reads
it instead of measuring again; an entry that is damaged or holds no plausible figure is measured anew;
with the cache off every process measures; a cache file carries a GPU model's figure to another machine,
not a CPU host's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember import config
from ember.backends import device
from ember.runtime.cache import DiskCache, content_key
from ember.runtime.portable import export_cache, read_cache_file

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = ("cpu", "a host", "x86_64", "a CPU", 2, "torch")


class Measure:
    """A stand-in for the copy that measures: returns `figure`, counting its calls."""

    def __init__(self, figure: float = 12.5e9):
        self.figure, self.calls = figure, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.figure


def _never() -> float:
    raise AssertionError("measured again: the stored figure was not read")


def _entry(root: Path, identity: tuple = IDENTITY) -> Path:
    return root / "device" / _key(identity)[:2] / _key(identity)


def _key(identity: tuple) -> str:
    return content_key("device", device.MEASUREMENT, identity)


def test_a_measured_figure_is_stored_and_read_back(tmp_path):
    measure = Measure()
    with config.override(cache_dir=str(tmp_path)):
        assert device.stored_bandwidth(IDENTITY, measure) == 12.5e9
        assert device.stored_bandwidth(IDENTITY, _never) == 12.5e9
        assert measure.calls == 1
        # Another device (here: another thread count) is measured for itself.
        other = (*IDENTITY[:4], 8, "torch")
        assert device.stored_bandwidth(other, Measure(3e9)) == 3e9
    assert json.loads((_entry(tmp_path) / device.BANDWIDTH_FILE).read_bytes()) == {"bandwidth": 12.5e9}


def test_a_fresh_process_reads_the_stored_figure(tmp_path):
    """The child's copy would fail: the figure it reports is the one this process stored."""
    threads = torch.get_num_threads()
    with config.override(cache_dir=str(tmp_path)):
        device.stored_bandwidth(device.device_identity(torch.device("cpu")), Measure(7.25e9))
    child = (
        "import torch\n"
        f"torch.set_num_threads({threads})\n"
        "from ember.backends import device\n"
        "def copy():\n"
        "    raise SystemExit('measured again')\n"
        "device._cpu_copy_bandwidth = copy\n"
        "print(device.device_limits(torch.device('cpu')).bandwidth)\n"
    )
    env = {**os.environ, "EMBER_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-c", child]
    done = subprocess.run(run, check=False, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) == 7.25e9


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[]",
        b"{}",
        b'{"bandwidth": -1}',
        b'{"bandwidth": 0}',
        b'{"bandwidth": NaN}',
        b'{"bandwidth": Infinity}',
        b'{"bandwidth": true}',
        b'{"bandwidth": "1e9"}',
    ],
)
def test_an_entry_without_a_plausible_figure_is_measured_anew(tmp_path, content):
    with config.override(cache_dir=str(tmp_path)):
        DiskCache().put("device", _key(IDENTITY), {device.BANDWIDTH_FILE: content})  # intact, but not a figure
        measure = Measure()
        assert device.stored_bandwidth(IDENTITY, measure) == 12.5e9
        assert measure.calls == 1


def test_a_damaged_entry_is_measured_anew_and_replaced(tmp_path):
    with config.override(cache_dir=str(tmp_path)):
        device.stored_bandwidth(IDENTITY, Measure(5e9))
        stored = _entry(tmp_path) / device.BANDWIDTH_FILE
        stored.write_bytes(b'{"bandwidth": 9e99}')  # no longer matches its manifest's checksum
        measure = Measure(6e9)
        assert device.stored_bandwidth(IDENTITY, measure) == 6e9
        assert measure.calls == 1
        assert device.stored_bandwidth(IDENTITY, _never) == 6e9  # the damaged entry was replaced


def test_an_unusable_measurement_is_not_stored(tmp_path):
    with config.override(cache_dir=str(tmp_path)):
        assert device.stored_bandwidth(IDENTITY, Measure(float("inf"))) == float("inf")
    assert not _entry(tmp_path).exists()


def test_with_the_cache_off_every_call_measures(tmp_path):
    measure = Measure()
    with config.override(cache_dir=str(tmp_path), cache=False):
        device.stored_bandwidth(IDENTITY, measure)
        device.stored_bandwidth(IDENTITY, measure)
    assert measure.calls == 2
    assert not (tmp_path / "device").exists()


def test_a_cache_file_carries_a_gpu_model_s_figure_not_a_cpu_host_s(tmp_path):
    gpu = ("cuda", "NVIDIA H200", "150000000000", "2619000", "6144", "driver", "13.0", "torch")
    cache = DiskCache(tmp_path / "cache")
    cache.put("schedule", "ab" * 32, {"schedule.pickle": b"a schedule"})
    with config.override(cache_dir=str(cache.root)):
        device.stored_bandwidth(IDENTITY, Measure())
        device.stored_bandwidth(gpu, Measure(4.2e12), kind="model")
    export_cache(tmp_path / "file", cache)
    _, entries = read_cache_file(tmp_path / "file")
    assert sorted(kind for kind, _, _ in entries) == ["model", "schedule"]
    # Imported on another machine, the GPU's figure is read, not measured again; the CPU's is measured.
    other = DiskCache(tmp_path / "other")
    for kind, key, files in entries:
        other.put(kind, key, files)
    with config.override(cache_dir=str(other.root)):
        assert device.stored_bandwidth(gpu, _never, kind="model") == 4.2e12
        measure = Measure()
        device.stored_bandwidth(IDENTITY, measure)
    assert measure.calls == 1
