"""Measuring: one step of a workload, timing, device ceilings, input rotation, peak memory, limits.

GPU times: the larger of a call's device time (the median of device events around it, each call
after an L2 flush and a device-side wait that covers the host's latency) and its host time
(the host's clock around calls launched back to back while the device sleeps): see `Timer`. CPU times are
`time.perf_counter` medians over enough calls to fill a time budget. When a
workload's inputs fit in the last-level cache (L2 on a GPU), calls rotate among several copies of
them, so a call does not find its inputs already in cache. Ceilings are measured at the start of
a run, never taken from datasheets: a large copy for bandwidth, a large matmul per dtype for FLOP/s.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ember.tools.bench.built import Built

# ---------------------------------------------------------------------------------------------
# One step: inference under no_grad, or forward + backward with fixed cotangents.


def tensors(x) -> list[torch.Tensor]:
    return [t for t in (x if isinstance(x, (tuple, list)) else [x]) if isinstance(t, torch.Tensor)]


class Step:
    """Runs `fn` once in the case's mode and returns every output (and, training, every gradient).

    Training differentiates with respect to the floating inputs and all parameters, with seeded
    random cotangents made once (ones would hide errors: a final norm of unit weight passes exactly
    zero gradient upstream), via `torch.autograd.grad`, so no `.grad` accumulates between calls.
    """

    def __init__(self, fn: Callable, train: bool, autocast: torch.dtype | None, device: torch.device):
        self.fn, self.train, self.autocast, self.device = fn, train, autocast, device
        self.cotangents: list[torch.Tensor] | None = None
        # torch's FLOP counter tracks modules with hooks that autograd.grad does not support:
        # counting runs .backward(inputs=...) instead, and clears the .grad it leaves.
        self.via_backward = False

    def _ctx(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def __call__(self, *inputs) -> list[torch.Tensor]:
        if not self.train:
            with torch.no_grad(), self._ctx():
                return tensors(self.fn(*inputs))
        with self._ctx():
            outs = [o for o in tensors(self.fn(*inputs)) if o.requires_grad]
        leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        if isinstance(self.fn, nn.Module):
            leaves += [p for p in self.fn.parameters() if p.requires_grad]
        if self.cotangents is None:
            # Drawn in float32 and cast, so that a float64 reference differentiates along the same
            # directions: float64's randn draws other numbers than float32's.
            gen = torch.Generator(device=outs[0].device).manual_seed(1)
            draws = [torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32) for o in outs]
            self.cotangents = [d.to(o.dtype) for d, o in zip(draws, outs)]
        if self.via_backward:
            torch.autograd.backward(outs, self.cotangents, inputs=leaves)
            grads = [leaf.grad for leaf in leaves]
            for leaf in leaves:
                leaf.grad = None
        else:
            grads = torch.autograd.grad(outs, leaves, self.cotangents, allow_unused=True)
        return [o.detach() for o in outs] + [g for g in grads if g is not None]


def prepare_inputs(inputs: tuple, train: bool) -> tuple:
    """Floating inputs require grad in training (so their gradients are checked too)."""
    if not train:
        return inputs
    return tuple(x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in inputs)


def upcast_copy(built: Built, inputs: tuple, dtype: torch.dtype) -> tuple:
    """The workload's function (a module: a copy, same already-rounded weights) and its floating
    inputs, in `dtype`: a reference's step (`reference`, the float64 rule of accuracy.py)."""
    fn = copy.deepcopy(built.fn).to(dtype) if isinstance(built.fn, nn.Module) else built.fn
    ref_inputs = tuple(
        x.detach().to(dtype).requires_grad_(x.requires_grad)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
        else x
        for x in inputs
    )
    return fn, ref_inputs


def reference(
    built: Built, inputs: tuple, train: bool, device: torch.device, dtype: torch.dtype
) -> tuple[list[torch.Tensor], torch.dtype]:
    """The same step without autocast, from the same weights and inputs, that a run in `dtype` is
    checked against, and the dtype it ran in: float32 for a low-precision workload; float64 for a
    float32 one, so that each output's tolerance (`tolerances`) grows with eager's own float32 error
    on it, as the float64 rule's does (a training step through batch norm over one image is far from
    float64 in eager too, and a float32 reference would count a compiler's equally good result as
    wrong). A float32 workload whose step does not run in float64 (an op without a float64 kernel,
    memory) is checked against float32; the case's record says which ran. A function that is not a
    module runs as it is in both attempts."""
    if dtype == torch.float32:
        try:
            return _step_in(built, inputs, train, device, torch.float64), torch.float64
        except Exception:  # noqa: BLE001 - any failure in float64 leaves the float32 reference
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return _step_in(built, inputs, train, device, torch.float32), torch.float32


def _step_in(built: Built, inputs: tuple, train: bool, device: torch.device, dtype: torch.dtype) -> list:
    fn, ref_inputs = upcast_copy(built, inputs, dtype)
    step = Step(fn, train, None, device)
    out = step(*ref_inputs)
    del fn
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (NaN if either has a NaN the other lacks)."""
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def max_err(outs: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    errs = errors(outs, ref)
    return max(errs) if errs else 0.0


def errors(outs: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    """Each output's `rel_err` against the reference ([inf] where the counts differ)."""
    if len(outs) != len(ref):
        return [math.inf]
    return [rel_err(o, r) for o, r in zip(outs, ref)]


def worst(outs: list[torch.Tensor], ref: list[torch.Tensor], tols: list[float]) -> tuple[float, float]:
    """The output furthest past its own tolerance, as (its error, its tolerance): the outputs pass
    where that error is at most that tolerance (a NaN error never is)."""
    errs = errors(outs, ref)
    if len(errs) != len(tols):
        return math.inf, min(tols, default=0.0)
    pairs = list(zip(errs, tols))
    return max(pairs, key=lambda p: p[0] / p[1] if p[0] == p[0] else math.inf, default=(0.0, 0.0))


def tolerance(dtype: torch.dtype, eager_err: float) -> float:
    """A compiled output may be as far from the reference (`reference`) as eager's is, twice, plus
    rounding slack."""
    slack = 1e-4 if dtype == torch.float32 else 2e-2
    return 2 * eager_err + slack


def tolerances(dtype: torch.dtype, eager_errs: list[float]) -> list[float]:
    """Each output's own `tolerance`: one output far from the reference in eager too (a gradient through
    an ill-conditioned batch norm) loosens no other's."""
    return [tolerance(dtype, e) for e in eager_errs]


# ---------------------------------------------------------------------------------------------
# The device: sync, cache size, timing, ceilings.


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_bytes(device: torch.device) -> tuple[int, str]:
    """The last-level cache a workload's inputs could stay in between calls: (bytes, name)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size, "L2"
    best = (0, "none")
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "size")) as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        n = int(size.rstrip("KMG")) * scale
        if n > best[0]:
            best = (n, f"L{level}")
    return best


def tensor_bytes(xs) -> int:
    return sum(x.numel() * x.element_size() for x in xs if isinstance(x, torch.Tensor))


def rotations(inputs: tuple, cache: int, limit: int = 32) -> int:
    """How many copies of the inputs to rotate among: enough to overflow the cache twice over."""
    size = tensor_bytes(inputs)
    if size == 0 or size > cache:
        return 1
    return min(limit, math.ceil(2 * cache / size) + 1)


def copies_of(inputs: tuple, n: int) -> list[tuple]:
    out = [inputs]
    for _ in range(n - 1):
        out.append(
            tuple(
                x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs
            )
        )
    return out


def _single_calls(fn: Callable[[], object], calls: int = 5) -> list[float]:
    """ms of the host's clock around each of `calls` calls made with the device idle."""
    singles = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        singles.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return singles


_FLUSH_BYTES = 256 << 20  # larger than any GPU's L2 (50 MB on the H100), as triton's do_bench


@dataclass
class Timer:
    """Median times of calls.

    On a GPU, `triton.testing.do_bench` alone (flush L2, record an event, call, record an event)
    mixes in the host in a way that depends on the flush: the device idles between the events
    whenever the host needs longer to launch the call's first kernel than the device needs for
    the flush (~0.09 ms on an H100), and for a host-bound call it times only the launches made
    after the flush ended. On the H100 machine: eager addmm + gelu 0.431 ms by do_bench, 0.407 with the
    host's latency hidden, 0.402 back to back; a 16-layer MLP at batch 1 (host-bound) 0.49 ms by
    do_bench for ember, 0.52-0.65 ms per call back to back. So a call is measured twice:

    - device: before each call, the L2 flush and then `torch.cuda._sleep` for longer than the
      host needs to launch it, so the call's kernels are queued before the device reaches them;
      device events around the call; the median;
    - host: the host's clock around up to 20 calls launched back to back while the device
      sleeps (so no launch waits for it), per call;

    and the call's time is the larger: what each of many calls in a row takes when the host and
    the device overlap. `last` keeps both. Ceilings (best=True) are do_bench's fastest call.
    """

    device: torch.device
    cpu_budget_s: float = 1.0  # CPU: time each variant for about this long
    gpu_rep_ms: int = 200
    last: dict | None = None
    _flush: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _cycles_per_ms: float | None = field(default=None, init=False, repr=False, compare=False)

    def median_ms(self, fn: Callable[[], object], best: bool = False) -> float:
        """Median ms of fn() (the fastest call instead, with best=True: for ceilings)."""
        if self.device.type == "cuda":
            if best:
                import triton.testing

                return float(triton.testing.do_bench(fn, warmup=25, rep=self.gpu_rep_ms, return_mode="min"))
            with torch.cuda.device(self.device):
                return self._gpu_ms(fn)
        for _ in range(2):
            fn()
        times: list[float] = []
        spent = 0.0
        while len(times) < 5 or (spent < self.cpu_budget_s and len(times) < 200):
            start = time.perf_counter()
            fn()
            dt = time.perf_counter() - start
            times.append(dt * 1000)
            spent += dt
        return min(times) if best else statistics.median(times)

    def _sleep_cycles_per_ms(self) -> float:
        if self._cycles_per_ms is None:
            cycles = 10_000_000
            torch.cuda._sleep(cycles)  # the first call may load a module
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_ms = cycles / start.elapsed_time(end)
        return self._cycles_per_ms

    def _host_ms(self, fn: Callable[[], object], latency: float, single: float) -> float:
        """The host's time per call: its clock around up to 20 calls launched back to back while
        the device sleeps, so no launch waits for the device. If the launch queue fills (~1024
        launches on the H100: a model's training step can make hundreds per call) the host blocks
        until the device wakes; then fewer calls, down to one."""
        calls = max(1, min(20, int(20 / max(latency, 1e-3))))  # ~20 ms of launching
        while True:
            asleep = calls * latency * 3 + 1.0  # ms
            torch.cuda.synchronize()
            torch.cuda._sleep(int(asleep * self._sleep_cycles_per_ms()))
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            spent = (time.perf_counter() - t) * 1e3
            torch.cuda.synchronize()
            if spent < 0.8 * asleep:
                return spent / calls
            if calls == 1:
                # One call fills the queue by itself: it waited for the sleep. Take its time with
                # the device awake (`single`); the device then sets the pace of its launches.
                return single
            calls //= 2

    def host_ms(self, fn: Callable[[], object]) -> float:
        """GPU: the host's time per call alone (calls launched back to back while the device sleeps)."""
        fn()
        singles = _single_calls(fn)
        self._sleep_cycles_per_ms()
        return self._host_ms(fn, max(singles), statistics.median(singles))

    def _gpu_ms(self, fn: Callable[[], object]) -> float:
        if self._flush is None:
            self._flush = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device=self.device)
        from ember.runtime.cudagraph_judge import SETTLING_CALLS

        fn()
        torch.cuda.synchronize()
        begin, calls = time.perf_counter(), 1
        # Warm up for ~25 ms, as do_bench, and past the calls over which the default mode records and judges its
        # CUDA graphs.
        while time.perf_counter() - begin < 0.025 or calls < SETTLING_CALLS:
            fn()
            calls += 1
        singles = _single_calls(fn)  # the host's latency, to size the waits below
        latency = max(singles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        estimate = max(start.elapsed_time(end), 1e-3)
        host_ms = self._host_ms(fn, latency, statistics.median(singles))
        # Device: each call after the flush and a wait of twice the host's latency (at most 50 ms).
        wait = int(min(50.0, 2 * latency + 0.05) * self._sleep_cycles_per_ms())
        reps = max(5, min(1000, int(self.gpu_rep_ms / (estimate + 2 * latency + 0.15))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            self._flush.zero_()
            torch.cuda._sleep(wait)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        device_ms = statistics.median(start.elapsed_time(end) for start, end in events)
        self.last = {"device_ms": device_ms, "host_ms": host_ms}
        return max(device_ms, host_ms)

    def time_step(self, step: Callable, input_sets: list[tuple]) -> float:
        """Median ms of step(*inputs), cycling through the input sets."""
        k = [0]

        def call():
            inputs = input_sets[k[0] % len(input_sets)]
            k[0] += 1
            return step(*inputs)

        return self.median_ms(call)


def busy_ms(step: Callable, input_sets: list[tuple], device: torch.device, calls: int = 5) -> float | None:
    """GPU: the device's busy time per call, the sum of its kernels' (and copies') times under
    torch.profiler over `calls` calls in a row; None on a CPU. Busy ÷ step time is the share of a
    step the GPU works; the rest it waits for the host."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    quiet_kineto()
    step(*input_sets[0])  # the profiler's start is not a call's cost
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            step(*input_sets[i % len(input_sets)])
        sync(device)
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.device_time for e in prof.events() if e.device_type == cuda) / 1000 / calls


def quiet_kineto() -> None:
    """Kineto, the profiler's back end, logs two lines to stderr each time a profile starts and
    stops ("USDT: ... profiler_start"): some 60 lines in one `ember bench`. KINETO_LOG_LEVEL 6 is
    above its highest level; it is read when kineto starts, at the first profile of the process.
    A value the user set is kept."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def _ceiling_sizes(device: torch.device, scale: str) -> tuple[int, int]:
    if scale == "tiny":
        return 1 << 22, 256
    return (1 << 28, 8192) if device.type == "cuda" else (1 << 26, 2048)


def _copy_ms(timer: Timer, n: int, device: torch.device) -> float:
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return timer.median_ms(lambda: dst.copy_(src), best=True)


def measure_ceilings(device: torch.device, dtypes: list[torch.dtype], scale: str = "gpu") -> dict:
    """Measured bandwidth (bytes read + written per second by a large copy) and matmul FLOP/s per dtype.

    Each from its fastest call: a ceiling is what the device can do, and on a shared CPU the median
    would include time other processes took."""
    timer = Timer(device, cpu_budget_s=0.5)
    n_copy, n_mm = _ceiling_sizes(device, scale)
    copy_ms = _copy_ms(timer, n_copy, device)
    moved = 2 * n_copy * 4
    flops = {}
    for dtype in dtypes:
        a = torch.randn(n_mm, n_mm, device=device, dtype=dtype)
        b = torch.randn(n_mm, n_mm, device=device, dtype=dtype)
        ms = timer.median_ms(lambda a=a, b=b: a @ b, best=True)
        flops[str(dtype).replace("torch.", "")] = 2 * n_mm**3 / (ms / 1000)
        del a, b
    return {
        "bandwidth_Bps": moved / (copy_ms / 1000),
        "copy_bytes": moved,
        "flops": flops,
        "matmul_n": n_mm,
    }


# ---------------------------------------------------------------------------------------------
# The limit: bytes that must move and FLOPs that must be done.


def _heads_of(query_shape, shape):
    """A key or value shape with the query's head count (GQA shares each key/value head among
    several query heads: the products run over every query head)."""
    return (*shape[:-3], query_shape[-3], *shape[-2:])


def _sdpa_formulas() -> dict:
    """FLOP formulas for the fused attention ops, on shapes: the CPU flash ops, which torch's counter
    does not cover, and the CUDA ones, whose formulas in torch assert as many key/value heads as
    query heads (GQA fails them)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def fwd(query, key, value, *args, out_shape=None, **kwargs):
        return fc.sdpa_flop_count(query, _heads_of(query, key), _heads_of(query, value))

    def bwd(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return fc.sdpa_backward_flop_count(grad_out, query, _heads_of(query, key), _heads_of(query, value))

    table = {}
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            table[getattr(aten, name)] = fwd
        if hasattr(aten, name + "_backward"):
            table[getattr(aten, name + "_backward")] = bwd
    return table


def count_flops(step: Step, inputs: tuple) -> int:
    """FLOPs of matmuls, convolutions and attention in one eager step (torch's FLOP counter).

    Pointwise and reduction arithmetic is not counted: for those workloads the byte floor is the
    limit. Causal attention counts the full square, as the counter does.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counting = Step(step.fn, step.train, step.autocast, step.device)
    counting.cotangents, counting.via_backward = step.cotangents, True
    try:
        with FlopCounterMode(display=False, custom_mapping=_sdpa_formulas()) as counter:
            counting(*inputs)
    except TypeError:
        # An op the counter's mode cannot run (torch's eager flex_attention under a dispatch mode): the
        # row has no FLOP floor, and its limit is the byte floor alone.
        return 0
    return int(counter.get_total_flops())


def min_bytes(fn: Callable, inputs: tuple, outputs: list[torch.Tensor], cotangents: list | None) -> int:
    """Each input (arguments, parameters, buffers, cotangents) read once, each output written once."""
    read = tensor_bytes(inputs)
    if isinstance(fn, nn.Module):
        read += tensor_bytes(fn.parameters()) + tensor_bytes(fn.buffers())
    read += tensor_bytes(cotangents or [])
    return read + tensor_bytes(outputs)


def floor_ms(limit: dict, ceilings: dict, dtype: torch.dtype) -> float | None:
    """The larger of the byte floor and the FLOP floor, in ms."""
    rate = ceilings["flops"].get(str(dtype).replace("torch.", ""))
    t_bytes = limit["bytes"] / ceilings["bandwidth_Bps"]
    t_flops = limit["flops"] / rate if rate else 0.0
    return max(t_bytes, t_flops) * 1000
