"""Launch configurations chosen by measurement (the setting `autotune`; mode='max-autotune').

A stage of the Triton backend. For each static kernel that moves enough bytes
(target.heuristics.tune.min_bytes), most bytes first, the candidates of codegen/triton_tuning.py
(launch_config's choice and its neighbours) are rendered, compiled in parallel threads, run once on
random operands and checked against the first candidate's result (a candidate that differs, fails
to compile or to run is dropped), then timed. The fastest wins if it beats the first's time by
tune.min_gain_percent; a winner starts another round around itself (coordinate descent, up to
tune.rounds rounds), else the round's first stays.

Time is read through a `Timer` (`clock()` for the budget, `time(run)` for a candidate's seconds per
call; each run carries the launch it makes as `run.launch`): `CudaTimer` on a GPU (warm-up, L2
flushed before each run, CUDA events around each, the median), `WallTimer` under Triton's CPU
interpreter; tests pass their own. The budget: a graph's tuning (with the GEMM choices of gemm=auto)
may add the fraction `autotune_budget` of its own compile time (at least `autotune_min_s`, class
Budget); a round that starts within it is finished, later ones keep what they have. Results go to
the disk cache (kind "tuning"), one entry per round, keyed by the kernel's source (its name left
out, so that graphs and models sharing a kernel share its tuning), its sizes and layouts, the
candidates, the device's name and SM count, the target and Triton: later compiles read them and
measure nothing.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Protocol

import sympy
import torch

from ember import config, log
from ember.backends.compile_workers import KERNEL_OPTIONS
from ember.codegen.triton import PRELUDE, TritonKernelSource, render_triton
from ember.codegen.triton_launch import LaunchConfig
from ember.codegen.triton_tuning import launch_candidates
from ember.runtime.cache import DiskCache, content_key, triton_identity
from ember.schedule.kernel import ComboKernel, Kernel
from ember.target import Target


class Timer(Protocol):
    """What the tuner reads time from."""

    def clock(self) -> float:
        """Seconds, monotonic: what the budget is spent in."""

    def time(self, run: Callable[[], None]) -> float:
        """Seconds per call of `run` (it launches one candidate once)."""


class WallTimer:
    """The host's clock: Triton's CPU interpreter runs a kernel inside the call."""

    def __init__(self, reps: int = 3):
        self.reps = reps

    def clock(self) -> float:
        return time.perf_counter()

    def time(self, run: Callable[[], None]) -> float:
        run()
        times = []
        for _ in range(self.reps):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


class CudaTimer:
    """CUDA events around each run, the L2 cache flushed before it (a 256 MiB write, longer than a
    launch's host time, so the GPU never waits for the host between the events), after warm-up
    runs; the median of up to `reps` runs, fewer for a slow kernel (about `seconds` in all)."""

    def __init__(self, device: torch.device, reps: int = 25, seconds: float = 0.01):
        self.device, self.reps, self.seconds = device, reps, seconds
        self._flush: torch.Tensor | None = None  # made at the first timing, outside any fake mode

    def clock(self) -> float:
        return time.perf_counter()

    def time(self, run: Callable[[], None]) -> float:
        if self._flush is None:
            self._flush = torch.empty(64 << 20, dtype=torch.int32, device=self.device)
        run()
        torch.cuda.synchronize(self.device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.reps)
        ]
        start, end = events[0]
        self._flush.zero_()
        start.record()
        run()
        end.record()
        end.synchronize()
        once = max(start.elapsed_time(end) / 1e3, 1e-6)
        reps = max(3, min(self.reps, int(self.seconds / once)))
        for start, end in events[:reps]:
            self._flush.zero_()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) / 1e3 for s, e in events[:reps])


def make_timer(device: torch.device | None, target: Target) -> Timer:
    """The timer the setting `autotune_timer` names (auto: CUDA events on a GPU, else the wall clock)."""
    choice = config.get("autotune_timer")
    gpu = device is not None and device.type == "cuda" and not target.interpreted
    if choice == "cuda" or (choice == "auto" and gpu):
        if not gpu:
            raise config.ConfigError("autotune_timer=cuda times candidates on a GPU, and this graph runs on none")
        return CudaTimer(device)
    # Under the interpreter a timing says little about a GPU: one run is enough (tests run it).
    return WallTimer(reps=1 if target.interpreted else 3)


@dataclass
class Budget:
    """What tuning may still take of a compile: `fraction` of the compile's own time so far (its
    time since `start`, on the timer's clock, less what tuning took), at least `min_seconds`, less
    what tuning took. Shared by a graph's GEMM choices (during scheduling) and its launch tuning
    (at build): a measurement starts only while some is left, and is charged when it ends."""

    fraction: float
    min_seconds: float
    start: float
    spent: float = 0.0
    spent_on: list[str] = field(default_factory=list)  # what was measured (not read from the cache)

    def left(self, timer: Timer) -> float:
        own = timer.clock() - self.start - self.spent
        return max(self.min_seconds, self.fraction * own) - self.spent

    def charge(self, seconds: float, what: str) -> None:
        self.spent += seconds
        self.spent_on.append(what)

    @classmethod
    def from_settings(cls, timer: Timer, compile_seconds: float) -> Budget:
        """The settings' budget (autotune_budget, autotune_min_s) for a compile that has run for
        `compile_seconds` so far."""
        return cls(config.get("autotune_budget"), config.get("autotune_min_s"), timer.clock() - compile_seconds)


_memo: dict[str, dict] = {}
_lock = threading.Lock()


def choose(
    key: str,
    candidates: Sequence,
    prepare: Callable[[], list[Callable[[], None] | None]],
    timer: Timer,
    budget: Budget,
    min_gain_percent: int,
) -> tuple[int, dict | None]:
    """The index of the candidate to use (0, the heuristic's, unless another is measurably faster),
    and the timings it was chosen by: {"seconds": [per candidate, None where dropped], ...} from
    memory, the disk cache, or a measurement now (`prepare()` compiles and checks the candidates,
    returning a launch per candidate, None where dropped), written to the cache. Without budget left
    and nothing cached: (0, None), nothing measured."""
    with _lock:
        timings = _memo.get(key)
    if timings is None:
        entry = DiskCache().get("tuning", key)
        if entry is not None:
            try:
                timings = json.loads(entry["timings.json"])
            except (KeyError, ValueError):
                timings = None
    if timings is None:
        if budget.left(timer) <= 0:
            return 0, None
        start = timer.clock()
        runs = prepare()
        seconds = [None if run is None else timer.time(run) for run in runs]
        timings = {"seconds": seconds, "tuning_seconds": timer.clock() - start}
        budget.charge(timings["tuning_seconds"], key)
        DiskCache().put("tuning", key, {"timings.json": json.dumps(timings).encode()})
    with _lock:
        _memo[key] = timings
    return _best(timings["seconds"], min_gain_percent), timings


def _best(seconds: list[float | None], min_gain_percent: int) -> int:
    """The fastest candidate if it beats the heuristic's (index 0) by min_gain_percent, else 0."""
    timed = [(t, i) for i, t in enumerate(seconds) if t is not None]
    if not timed:
        return 0
    t, i = min(timed)
    if seconds[0] is None or t * (1 + min_gain_percent / 100) < seconds[0]:
        return i
    return 0


def tuning_key(kernel: Kernel, source: TritonKernelSource, candidates: list[LaunchConfig], target: Target) -> str:
    """What a kernel's timings depend on: its source without its name, its buffers' layouts, its
    sizes, the candidates, the device (name and SM count), the target and Triton."""
    text = source.source.replace(f"def {kernel.name}(", "def kernel(", 1)
    buffers = [
        (str(p.value.dtype), [str(s) for s in p.value.shape], [str(s) for s in _layout(p.value)])
        for p in source.params
        if p.kind == "buffer"
    ]
    return content_key(
        "launch-tuning",
        text,
        buffers,
        [str(s) for s in _sizes(source)],
        [json.dumps(asdict(c), sort_keys=True) for c in candidates],
        target.device_name,
        target.sm_count,
        target=target.key(),
        toolchain=triton_identity(),
    )


def _layout(v) -> tuple:
    from ember.ir.graph import layout_of

    return tuple(layout_of(v))


def _sizes(r: TritonKernelSource) -> list[int]:
    sizes = [p.value for p in r.params if p.kind == "size"] + [r.xnumel] + ([r.rnumel] if r.launch.rblock else [])
    return [int(sympy.sympify(s)) for s in sizes]


def _bytes(kernel: Kernel) -> int:
    total = 0
    for v in list(kernel.reads) + list(kernel.writes):
        n = sympy.sympify(sympy.Mul(*v.shape)) if v.shape else sympy.Integer(1)
        total += int(n) * v.dtype.itemsize if n.is_Integer else 0
    return total


def tune_launches(
    kernels: list[Kernel],
    rendered: dict[str, TritonKernelSource],
    target: Target,
    device: torch.device | None,
    load_module: Callable[[str], ModuleType],
    timer: Timer,
    budget: Budget,
) -> dict[str, TritonKernelSource]:
    """The kernels whose measured fastest launch differs from the heuristic's, rendered with it.
    Kernels of symbolic sizes, combo kernels and those moving fewer than tune.min_bytes keep theirs."""
    h = target.heuristics.tune
    tunable = [
        k
        for k in kernels
        if k.name in rendered
        and not isinstance(k, ComboKernel)
        and _static(rendered[k.name])
        and _bytes(k) >= h.min_bytes
    ]
    tunable.sort(key=_bytes, reverse=True)  # the budget goes to the kernels that move the most
    chosen: dict[str, TritonKernelSource] = {}
    for k in tunable:
        try:
            best = _tune_kernel(k, target, device, load_module, timer, budget)
        except Exception as e:  # tuning is an optimization: the heuristic's launch stays (strict: raise)
            if config.get("strict"):
                raise
            log.artifact("cache", "autotune", f"{k.name}: not tuned ({type(e).__name__}: {e})"[:300])
            continue
        if best is not None:
            chosen[k.name] = best
    return chosen


def _tune_kernel(k: Kernel, target: Target, device, load_module, timer: Timer, budget: Budget):
    """The kernel rendered with its fastest launch, or None where the heuristic's stays. Up to
    tune.rounds rounds, each measuring the last winner's neighbours not measured yet (coordinate
    descent), while a round finds a faster one and budget is left."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    h = target.heuristics.tune
    winner, tried = None, []
    for _ in range(h.rounds):
        around = winner.launch if winner is not None else None
        candidates = launch_candidates(k, target, around)
        candidates = candidates[:1] + [c for c in candidates[1:] if c not in tried]
        if len(candidates) < 2:
            break
        tried += candidates
        sources = [render_triton(k, target, c) for c in candidates]
        key = tuning_key(k, sources[0], candidates, target)

        def prepare(sources=sources):
            return _prepare(k, sources, device, load_module)

        with unset_fake_temporarily():  # compilers run under AOTAutograd's fake mode
            best, timings = choose(key, candidates, prepare, timer, budget, h.min_gain_percent)
        if timings is not None:
            log.artifact(
                "cache", "autotune", f"{k.name}: {candidates[best]} of {len(candidates)}: {timings['seconds']}"
            )
        if not best:
            break
        winner = sources[best]
    return winner


def _static(r: TritonKernelSource) -> bool:
    try:
        _sizes(r)
    except TypeError:
        return False
    return all(
        sympy.sympify(s).is_Integer for p in r.params if p.kind == "buffer" for s in (*p.value.shape, *_layout(p.value))
    )


def _prepare(
    kernel: Kernel, sources: list[TritonKernelSource], device, load_module: Callable[[str], ModuleType]
) -> list[Callable[[], None] | None]:
    """A launch per candidate on random operands, None for one that does not compile, run, or give
    the heuristic's (the first's) result."""
    device = device or torch.device("cpu")
    fns: list = [None] * len(sources)
    # Loaded here, in turn: candidates differing only in their constants share a module, and the
    # threads below would import it twice at once. The threads compile (Triton's passes and ptxas
    # run outside the GIL) and read no setting.
    modules: dict[str, ModuleType] = {}
    for r in sources:
        if r.source not in modules:
            modules[r.source] = load_module(PRELUDE + "\n\n" + r.source + "\n")

    def compile_one(i: int):
        fn = getattr(modules[sources[i].source], kernel.name)
        if device.type == "cuda":
            r = sources[i]
            args = [p.value.dtype for p in r.params if p.kind == "buffer"] + _sizes(r)
            fn.warmup(*args, grid=(1,), num_warps=r.launch.num_warps, **KERNEL_OPTIONS, **_constants(r))
        return fn

    with ThreadPoolExecutor(max(1, min(config.get("compile_threads"), len(sources)))) as pool:
        futures = [pool.submit(compile_one, i) for i in range(len(sources))]
        for i, f in enumerate(futures):
            try:
                fns[i] = f.result()
            except Exception as e:  # noqa: BLE001 - a candidate this device cannot hold is no candidate
                log.artifact("cache", "autotune", f"{kernel.name} {sources[i].launch}: {type(e).__name__}: {e}"[:300])
    if fns[0] is None:
        return [None] * len(sources)
    pristine = _operands(sources[0], device)
    work = [t.clone() for t in pristine]
    buffers = [p.value for p in sources[0].params if p.kind == "buffer"]
    written = [i for i, v in enumerate(buffers) if any(v is w for w in kernel.writes)]
    runs: list[Callable[[], None] | None] = []
    expected = None
    for fn, r in zip(fns, sources):
        run = None if fn is None else _launch(fn, r, work)
        if run is not None:
            try:
                for t, p in zip(work, pristine):
                    t.copy_(p)
                run()
                got = [work[i].clone() for i in written]
                if expected is None:
                    expected = got
                elif not all(_same(a, b) for a, b in zip(got, expected)):
                    log.artifact("cache", "autotune", f"{kernel.name} {r.launch}: another result than the heuristic's")
                    run = None
            except Exception as e:  # noqa: BLE001 - a candidate that fails to run is no candidate
                log.artifact("cache", "autotune", f"{kernel.name} {r.launch}: {type(e).__name__}: {e}"[:300])
                run = None
        runs.append(run)
    return runs


def _constants(r: TritonKernelSource) -> dict:
    return {"XBLOCK": r.launch.xblock, **({"RBLOCK": r.launch.rblock} if r.launch.rblock else {})}


def _launch(fn, r: TritonKernelSource, buffers: list[torch.Tensor]) -> Callable[[], None]:
    sizes = _sizes(r)
    per_program = r.launch.rows_per_program or r.launch.xblock
    grid = (max(1, -(-sizes[-1 - bool(r.launch.rblock)] // per_program)),)
    consts = _constants(r)

    def run():
        fn[grid](*buffers, *sizes, **consts, num_warps=r.launch.num_warps, **KERNEL_OPTIONS)

    run.launch = r.launch  # what it launches, for a timer that prices candidates (tests)
    return run


def _operands(r: TritonKernelSource, device: torch.device) -> list[torch.Tensor]:
    """A tensor per buffer parameter, of its layout: random floats, zero integers (an index is then
    always in range) and booleans."""
    out = []
    for p in r.params:
        if p.kind != "buffer":
            continue
        v = p.value
        shape, stride = [int(s) for s in v.shape], [int(s) for s in _layout(v)]
        extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
        if v.dtype.is_floating_point:
            flat = torch.randn(extent, device=device).to(v.dtype)
        else:
            flat = torch.zeros(extent, dtype=v.dtype, device=device)
        out.append(flat.as_strided(shape, stride))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    tol = 1e-3 if a.dtype.itemsize >= 4 else 2e-2
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol, equal_nan=True)
