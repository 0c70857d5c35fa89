"""`ember profile WORKLOAD --host`: where the host's time per step goes, layer by layer, from cProfile.

A host-bound step (the device waits for launches) is a question about Python: which layer between the
user's call and the kernel launch spends the time. The step runs `calls` times under cProfile with no
synchronization inside, and each function's own time (cProfile's tottime) is charged to the layer its
file belongs to:

- Dynamo: frame evaluation and guards that run in Python (`torch/_dynamo`); guards compiled to C++
  are charged to the builtin that runs them;
- AOTAutograd: the runtime wrappers around the compiled forward and backward (`torch/_functorch`);
- autograd: `torch/autograd` in Python; the engine itself is C++ and shows as builtins;
- ember: ember's generated host program and its runtime (`ember/`);
- Inductor: Inductor's runtime (`torch/_inductor`), for comparison with `--compiler inductor`;
- Triton: Triton's Python launcher (`triton/`);
- other torch Python, other Python;
- builtins: C functions called from Python (tensor allocation, ATen calls, the launch itself).

Host time per step is measured apart, without the profiler, so the profiler's own cost is visible as the
difference: the calls alone (on a GPU, the time to enqueue them) and with the wait for the device after.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_EMBER = str(Path(__file__).resolve().parents[1]) + "/"  # this package's folder

# Installed libraries first: a site-packages folder may lie under a checkout named like ember's.
LAYERS = (
    ("Dynamo", ("torch/_dynamo/",)),
    ("AOTAutograd", ("torch/_functorch/",)),
    ("autograd", ("torch/autograd/",)),
    ("Inductor", ("torch/_inductor/",)),
    ("Triton", ("/triton/",)),
    ("other torch", ("/torch/",)),
)


def layer_of(filename: str) -> str:
    """The layer a function's file belongs to; C functions ('~') are builtins."""
    if filename == "~" or filename.startswith("<built-in"):
        return "builtins"
    path = filename.replace("\\", "/")
    if path.startswith("<ember"):  # the generated host program
        return "ember"
    for name, marks in LAYERS:
        if any(m in path for m in marks) and ("/site-packages/" in path or "/dist-packages/" in path):
            return name
    if path.startswith(_EMBER):
        return "ember"
    for name, marks in LAYERS:  # a source checkout of torch or Triton
        if any(m in path for m in marks):
            return name
    return "other Python"


@dataclass
class HostProfile:
    calls: int
    host_us: float  # per step, the calls alone (no profiler): on a GPU, the time to enqueue them
    wall_us: float  # per step, the calls and the wait for the device after them
    profiled_us: float  # per step, the calls under cProfile
    layers_us: dict[str, float] = field(default_factory=dict)  # per step, own time by layer
    top: list[tuple[float, float, str]] = field(default_factory=list)  # (µs per step, calls per step, function)

    def table(self) -> str:
        head = f"host per step: {self.host_us:.1f} µs to run the calls ({self.wall_us:.1f} µs with the wait"
        lines = [
            f"{head} for the device after them), {self.profiled_us:.1f} µs under cProfile",
            "own time by layer (µs per step, under cProfile):",
        ]
        total = sum(self.layers_us.values()) or 1.0
        lines += [
            f"  {name:<13}{us:10.1f} {100 * us / total:5.1f}%"
            for name, us in sorted(self.layers_us.items(), key=lambda kv: -kv[1])
        ]
        lines.append("top functions by own time (µs per step, calls per step):")
        lines += [f"  {us:9.1f} {n:7.1f}  {name}" for us, n, name in self.top]
        return "\n".join(lines)


def _describe(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":
        return name
    short = filename.replace("\\", "/")
    if short.startswith(_EMBER):
        short = "ember/" + short[len(_EMBER) :]
    for cut in ("/site-packages/", "/dist-packages/"):
        if cut in short:
            short = short.split(cut, 1)[1]
    return f"{short}:{line} {name}"


def host_profile(step: Callable[[], object], calls: int = 50, top: int = 25, sync: Callable[[], None] = lambda: None):
    """Profile `calls` runs of `step` (already compiled and warm). `sync` runs before and after each
    timed block, never inside it, so the host is free to run ahead of the device as it would in a
    loop; the host time is taken before the last `sync` (where launches block because the device's
    queue is full, the step is device-bound and the figure says so only by nearing the wall time)."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    enqueued = time.perf_counter()
    sync()
    host_us = (enqueued - start) * 1e6 / calls
    wall_us = (time.perf_counter() - start) * 1e6 / calls

    profiler = cProfile.Profile()
    sync()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    profiled_us = (time.perf_counter() - start) * 1e6 / calls
    sync()

    stats = pstats.Stats(profiler).stats  # func -> (primitive calls, calls, tottime, cumtime, callers)
    layers: dict[str, float] = {}
    rows = []
    for func, (_, ncalls, tottime, _, _) in stats.items():
        us = tottime * 1e6 / calls
        layers[layer_of(func[0])] = layers.get(layer_of(func[0]), 0.0) + us
        rows.append((us, ncalls / calls, _describe(func)))
    rows.sort(key=lambda r: -r[0])
    return HostProfile(calls, host_us, wall_us, profiled_us, layers, rows[:top])
