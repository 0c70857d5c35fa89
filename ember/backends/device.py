"""What a device is and how fast it is: the facts the backends put in their Target (ember/target.py).

The bandwidth is *measured* (a large copy, once per device and process, about 50 ms); the
compute rate is the specification's vector (not tensor-core) fp32 rate, matched by device name;
the launch cost is a typical figure. schedule/cost.py's roofline estimate, the GEMM choice
(gemm_tuning.py) and realize.py's rule for broadcast transcendental work read them from the Target;
the rate and launch cost (not the measured bandwidth) are part of the Target's cache key.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch


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


@functools.lru_cache(maxsize=8)
def device_limits(device: torch.device) -> DeviceLimits:
    """The device's name, SM count and limits; its bandwidth is measured on first use in this process."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # compilers run under AOTAutograd's fake mode: copies would be free
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            rate = next((r for key, r in _GPU_FLOPS.items() if key in props.name), _UNKNOWN_GPU_FLOPS)
            return DeviceLimits(props.name, props.multi_processor_count, _cuda_copy_bandwidth(device), rate, 4e-6)
        threads = torch.get_num_threads()
        # AVX2: two 8-wide fp32 FMA units per core at ~2.5 GHz, counted as 32 FLOP/cycle.
        return DeviceLimits(f"CPU x{threads}", 0, _cpu_copy_bandwidth(), threads * 2.5e9 * 32, 2e-6)
