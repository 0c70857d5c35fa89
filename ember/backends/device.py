"""What a device is and how fast it is: the facts the backends put in their Target (ember/target.py).

The bandwidth is *measured* (a large copy: 0.24 s of a first step on an H200, 0.1-0.2 s on a
2-core CPU), once per GPU model or CPU host: the disk cache keeps the figure under what identifies
the device where it was measured (`device_identity`: the GPU's name, memory, memory clock and bus,
the driver and CUDA, or the host, its CPU and thread count; the torch version; the way of
measuring), so a later process reads it instead. A GPU's figure is a fact of its model (kind
`model`): a cache file carries it, so that a machine of a fleet that imports one starts with the
figure the schedules it carries were made with, instead of measuring for a quarter of a second; a
CPU's is a fact of its host (kind `device`), left out of cache files. A missing, damaged or
unreadable entry is measured anew, as is every
figure after `ember cache clear`; with the setting `cache` off every process measures
(`stored_measurement` keeps any such fact of this machine: backends/cpu_products.py's product times
too). The compute rate is the specification's vector (not
tensor-core) fp32 rate, matched by device name; the launch cost is a typical figure.
schedule/cost.py's roofline estimate, the GEMM choice (gemm_tuning.py) and realize.py's rule for
broadcast transcendental work read them from the Target; the rate and launch cost (not the
measured bandwidth) are part of the Target's cache key.
"""

from __future__ import annotations

import functools
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ember import log
from ember.runtime.cache import DiskCache, content_key


@dataclass(frozen=True)
class DeviceLimits:
    name: str  # "NVIDIA H100 80GB HBM3", "CPU x16"
    sm_count: int  # streaming multiprocessors (0: not a GPU)
    bandwidth: float  # bytes/s, measured
    flop_rate: float  # FLOP/s, from the specification (fp32, no tensor cores)
    launch_seconds: float


# fp32 vector (non-tensor-core) FLOP/s from NVIDIA's datasheets; matched by device name.
_GPU_FLOPS = {"H200": 67e12, "H100": 67e12, "A100": 19.5e12, "L40": 90e12, "4090": 82e12}
_UNKNOWN_GPU_FLOPS = 20e12


T = TypeVar("T")


def _cuda_copy_bandwidth(device: torch.device) -> float:
    n = 1 << 28  # 256 MiB each way: far past L2
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * n / best


def _cpu_copy_bandwidth() -> float:
    n = 1 << 26  # 64 MiB: past the last-level cache of most machines
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best


# How the bandwidth is measured, in the stored figure's key: a change to _cuda_copy_bandwidth or
# _cpu_copy_bandwidth (sizes, repeats) takes a new number here, so no figure of the old way is read.
MEASUREMENT = "copy-best-of-5/1"
BANDWIDTH_FILE = "bandwidth.json"


@functools.lru_cache(maxsize=8)
def device_limits(device: torch.device) -> DeviceLimits:
    """The device's name, SM count and limits; its bandwidth is read from the disk cache, or measured
    (and stored) on this machine's first use of the device."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # compilers run under AOTAutograd's fake mode: copies would be free
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            rate = next((r for key, r in _GPU_FLOPS.items() if key in props.name), _UNKNOWN_GPU_FLOPS)
            measure = functools.partial(_cuda_copy_bandwidth, device)
            bandwidth = stored_bandwidth(device_identity(device), measure, kind="model")
            return DeviceLimits(props.name, props.multi_processor_count, bandwidth, rate, 4e-6)
        threads = torch.get_num_threads()
        bandwidth = stored_bandwidth(device_identity(device), _cpu_copy_bandwidth)
        # AVX2: two 8-wide fp32 FMA units per core at ~2.5 GHz, counted as 32 FLOP/cycle.
        return DeviceLimits(f"CPU x{threads}", 0, bandwidth, threads * 2.5e9 * 32, 2e-6)


def device_identity(device: torch.device) -> tuple:
    """What the measured bandwidth of `device` depends on: the GPU's model (its name, memory, memory
    clock and bus width, and the driver) or the CPU's host (its name, CPU model and the threads a copy
    uses), and the torch that copies."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts = tuple(
            str(getattr(props, name, "")) for name in ("name", "total_memory", "memory_clock_rate", "memory_bus_width")
        )
        return ("cuda", *facts, _first_line("/proc/driver/nvidia/version"), torch.version.cuda, torch.__version__)
    return ("cpu", platform.node(), platform.machine(), _cpu_model(), torch.get_num_threads(), torch.__version__)


def _first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def stored_bandwidth(identity: tuple, measure: Callable[[], float], kind: str = "device") -> float:
    """The bandwidth the disk cache keeps for `identity`, else `measure()`'s, stored there for the
    processes after this one. An entry that is not one finite positive figure is a miss. `kind`:
    "device" for a fact of this machine, "model" for one a cache file carries to others."""

    def encode(bandwidth: float) -> bytes:
        return json.dumps({"bandwidth": bandwidth}).encode()

    what = "a measured bandwidth"
    return stored_measurement((MEASUREMENT, identity), BANDWIDTH_FILE, measure, encode, _parse, what, kind)


def stored_measurement(
    content: tuple,
    file: str,
    measure: Callable[[], T],
    encode: Callable[[T], bytes],
    decode: Callable[[bytes], T | None],
    what: str,
    kind: str = "device",
) -> T:
    """The disk cache's figure for `content` (kind "device": a fact of this machine, which an exported
    cache file leaves out; "model": one of a device model, which it carries), else `measure()`'s, stored
    for the processes after this one where `decode` takes its bytes back (an unusable figure is not
    stored). An entry `decode` refuses is measured anew."""
    cache = DiskCache()
    key = content_key(kind, *content)
    entry = cache.get(kind, key)
    if entry is not None:
        found = decode(entry.files.get(file, b""))
        if found is not None:
            return found
        log.artifact("cache", "reject", f"{entry.path}: not {what}; measuring again")
    value = measure()
    data = encode(value)
    if decode(data) is not None:
        cache.put(kind, key, {file: data})
    return value


def _parse(data: bytes) -> float | None:
    try:
        value = json.loads(data)["bandwidth"]
    except (ValueError, TypeError, KeyError):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)
