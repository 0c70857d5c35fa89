"""Whether a frozen linear layer's product runs faster as oneDNN's over a prepacked weight
(`mkldnn._linear_pointwise`) than as ATen's (`mm`/`addmm`, MKL's sgemm) on this CPU, at its shape:
measured once, both on the same random operands taking turns, and kept in the disk cache under the
CPU's identity (kind "device": a fact of this machine, which an exported cache file leaves out).

Neither wins everywhere: which one does depends on the CPU and the shape (docs/decisions.md, "CPU linear
layers under freezing"). Each takes its fastest of a few rounds, so that a busy moment of the machine
does not decide for good.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ember import log
from ember.backends.device import device_identity, stored_measurement

MEASUREMENT = "linear product v2"  # the fastest round
RESULT_FILE = "linear.json"
# Packed only where oneDNN takes at most this share of ATen's time: a tie keeps the model's own weight
# (a packed weight is a second copy of it) and ATen's product, which ember's kernels may read around.
MARGIN = 0.95
ROUND_SECONDS = 0.002  # each timed round runs the product for about this long
ROUNDS = 5


def packed_is_faster(rows: int, k: int, n: int, bias: bool) -> bool:
    """Whether oneDNN's product over a packed [n, k] weight beats ATen's for [rows, k] inputs."""
    times = measured_times(rows, k, n, bias)
    return times["packed_us"] <= MARGIN * times["aten_us"]


def measured_times(rows: int, k: int, n: int, bias: bool, measure: Callable | None = None) -> dict[str, float]:
    """{"packed_us", "aten_us"}: the disk cache's for this CPU and shape, else measured and stored."""

    def timed() -> dict[str, float]:
        times = (measure or _measure)(rows, k, n, bias)
        log.artifact(
            "cache",
            "measured",
            f"linear [{rows}, {k}] x [{k}, {n}]{' + bias' if bias else ''}: oneDNN packed "
            f"{times['packed_us']:.1f} us, ATen {times['aten_us']:.1f} us",
        )
        return times

    content = (MEASUREMENT, device_identity(torch.device("cpu")), rows, k, n, bias)
    return stored_measurement(
        content, RESULT_FILE, timed, lambda times: json.dumps(times).encode(), _parse, "a measured product time"
    )


def _measure(rows: int, k: int, n: int, bias: bool) -> dict[str, float]:
    with unset_fake_temporarily(), torch.no_grad():
        gen = torch.Generator().manual_seed(0)  # not the caller's random stream
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen) if bias else None
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        wt = w.t()
        candidates = {
            "packed_us": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""),
            "aten_us": (lambda: torch.addmm(b, x, wt)) if bias else (lambda: torch.mm(x, wt)),
        }
        calls = {name: _calls_per_round(fn) for name, fn in candidates.items()}
        rounds: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(ROUNDS):  # taking turns: a slow moment of the machine falls on both
            for name, fn in candidates.items():
                start = time.perf_counter()
                for _ in range(calls[name]):
                    fn()
                rounds[name].append((time.perf_counter() - start) / calls[name] * 1e6)
    return {name: min(r) for name, r in rounds.items()}


def _calls_per_round(fn: Callable) -> int:
    fn()  # warm-up: oneDNN picks and builds its kernel on the first call
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, min(1000, int(ROUND_SECONDS / once)))


def _parse(data: bytes) -> dict[str, float] | None:
    try:
        found = json.loads(data)
        times = {name: float(found[name]) for name in ("packed_us", "aten_us")}
    except (ValueError, TypeError, KeyError):
        return None
    return times if all(math.isfinite(t) and t > 0 for t in times.values()) else None
