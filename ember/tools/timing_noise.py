"""How far a measured time can be trusted: the spread of its rounds and how busy the machine was.

`ember demo` and `ember bench` time each function in several rounds that take turns. On a quiet
machine the rounds agree; when other work competes for the CPUs (a 2-core machine running a test
suite beside the benchmark) one round can be a hundred times slower than the next, and a single
number hides that. Both tools show the spread and print these warnings instead of a confident
speed-up.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# Rounds whose slowest and fastest differ by more than this fraction of their median: the time is
# not reliable. On a quiet machine the rounds of one function agree within a few percent.
SPREAD_LIMIT = 0.5
# A 1-minute load average above this many runnable processes per usable core, read before timing:
# other work holds at least half the CPUs, and CPU kernels that use every core wait for it.
LOAD_PER_CORE_LIMIT = 0.5


@dataclass(frozen=True)
class Spread:
    """min, median and max of a set of samples (times of rounds, or ratios of them)."""

    low: float
    median: float
    high: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if not samples:
            raise ValueError("a spread needs at least one sample")
        return cls(min(samples), statistics.median(samples), max(samples))

    @property
    def relative(self) -> float:
        """(max - min) / median: 0 when every round agrees."""
        if self.high == self.low:
            return 0.0
        return (self.high - self.low) / self.median if self.median > 0 else math.inf


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), which bounds the threads its kernels use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def load_warning(load: float | None, cpus: int) -> str | None:
    """A warning when the load average says other work holds a large share of the CPUs."""
    if load is None or load <= LOAD_PER_CORE_LIMIT * cpus:
        return None
    return (
        f"the 1-minute load average is {load:.2f} on {cpus} usable CPU{'s' if cpus != 1 else ''}: other work "
        "competes for them, so CPU times will be slow and uneven; rerun on a quiet machine to trust them"
    )


def spread_warning(what: str, samples: Sequence[float], unit: str = "ms") -> str | None:
    """A warning when the rounds of one measurement disagree by more than SPREAD_LIMIT of their median."""
    if len(samples) < 2:
        return None
    s = Spread.of(samples)
    if s.relative <= SPREAD_LIMIT:
        return None
    return (
        f"{what}: rounds took {s.low:.3g} to {s.high:.3g} {unit} (median {s.median:.3g}), "
        f"{s.relative:.0%} of the median apart: this time is not reliable"
    )
