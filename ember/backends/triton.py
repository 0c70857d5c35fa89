"""GPU backend: one Triton kernel per fused group, all of a graph's kernels in one module.

Stages: render (Triton source) -> module file in the content cache -> import (from a private
copy of the checked bytes, at first use: kernel_module.py) -> Triton's own stages (ttir -> ttgir -> llir ->
ptx -> cubin), which Triton caches on disk by source.
The kernels of a graph are compiled ahead of the first call: by worker processes into Triton's
disk cache for large graphs (compile_workers.py: Triton's front end holds the GIL), then loaded,
or compiled, by this process's threads (MLIR passes and ptxas run outside the GIL).

Launch. `kernel[grid](...)` costs tens of microseconds of Python per call: Triton binds the
arguments, recomputes their specialization (pointer alignment, ints equal to 1 or divisible
by 16) and looks the compiled kernel up, every time. Every kernel is compiled ahead with every
pointer assumed 16-byte aligned, its static sizes as they are and its symbolic ones as stand-ins
that assume only what holds at every size (`_stand_in`), so the host program launches that
compiled binary directly (`direct_launch`), the grid computed per call where sizes vary: through torch's static
CUDA launcher (the C++ one Inductor uses), given integer addresses, where this torch has it and
the kernel needs nothing it lacks (scratch memory, several CTAs, launch hooks); else through
Triton's own compiled launcher. Host cost per launch on the H100 machine (busy GPU, so only
the host's time counts): kernel[grid] 18.7 us, Triton's launcher
8.2 us, the static launcher with addresses 6.5 us. What could break the alignment assumption is
checked inline: a buffer the host program did not allocate (an input, an extern's result, an
alias) that is misaligned takes the `kernel[grid]` path, which specializes for it as Triton
always does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import sympy
import torch

from ember import config, log, stats
from ember.backends import compile_workers, kernel_dedup, static_launch
from ember.backends.compile_workers import KERNEL_OPTIONS
from ember.backends.gemm_tuning import GemmTuning, precompile_gemms
from ember.backends.kernel_dedup import SHARED
from ember.backends.kernel_module import KernelFunction, KernelModule
from ember.backends.launch_tuning import Budget, Timer, make_timer, tune_launches
from ember.backends.static_launch import LaunchRecords, StaticLaunch
from ember.backends.table_launch import TableLaunch
from ember.backends.triton_target import gpu_arch, interpreting, make_target
from ember.codegen.gemm_triton import GemmKernelSource, render_gemm
from ember.codegen.render import print_host_index
from ember.codegen.triton import PRELUDE, TritonKernelSource, render_triton
from ember.codegen.triton_combo import (
    TABLE_FILL_ARGS,
    TABLE_FILL_BIAS,
    TABLE_FILL_SOURCE,
    TritonTableSource,
    render_triton_combo,
    render_triton_table,
)
from ember.runtime.cache import triton_identity
from ember.schedule.gemm import is_gemm_kernel
from ember.schedule.kernel import ComboKernel, Kernel
from ember.schedule.memory import MemoryPlan
from ember.target import Target

# Graphs with at least this many kernels to compile wait for the worker processes
# (compile_workers.py) to start, if they have not; fewer compile in this process's threads unless
# workers are ready already (started by an earlier graph's build, or early: start_compile_workers).
WORKERS_FROM_KERNELS = 16


class TritonBackend:
    """The Backend (backends/base.py) of NVIDIA GPUs, and of Triton's CPU interpreter for tests."""

    name = "triton"

    def __init__(self, device=None, timer: Timer | None = None):
        _check_can_run(device)
        if interpreting():
            _interpret_as_compiled()
        self.device = device
        self._target = make_target(device)
        # Tuning (setting `autotune`: launch configurations, and GEMM choices under gemm=auto) times
        # candidates with `timer` (None: the one the setting autotune_timer names), within one budget
        # from this graph's compile time (_tuning): the compile starts here.
        self._timer = timer
        self._budget: Budget | None = None
        self._created = time.perf_counter()
        # GEMM tuning is a stage of this backend: it compiles the tiles it times as this backend
        # loads its kernels.
        self.gemm_chooser = GemmTuning(self._target, device, self._load, self._tuning).choose
        self.rendered: dict[str, TritonKernelSource] = {}
        self.sources: dict[str, str] = {}
        self.full_source = ""
        self.direct: set[str] = set()  # kernels launched through Triton's compiled launcher
        self.static: dict[str, StaticLaunch] = {}  # kernels launched through torch's static launcher
        self.gemm_kernels: dict[str, GemmKernelSource] = {}  # GEMM template kernels (codegen/gemm_triton.py)
        self._module_seen = False  # the kernel module was in ember's cache already (_module_of)

    def target(self) -> Target:
        return self._target

    def build(self, kernels: list[Kernel], memory: MemoryPlan) -> dict[str, object]:
        """`memory` (the memory plan) is not needed: Triton promises the compiler nothing about
        aliasing, and a program reads each element it writes in place before storing it."""
        import triton

        clock = _BuildClock()
        parts = [PRELUDE]
        for k in kernels:
            if is_gemm_kernel(k):
                r = render_gemm(k, self._target)
            elif isinstance(k, ComboKernel) and k.table:  # one body over many parts' buffers
                r = render_triton_table(k, self._target)
            elif isinstance(k, ComboKernel):  # independent pointwise kernels in one launch
                r = render_triton_combo(k, self._target)
            else:
                r = render_triton(k, self._target)
            if is_gemm_kernel(k):
                self.gemm_kernels[k.name] = r
            else:
                self.rendered[k.name] = r
            self.sources[k.name] = r.source
            parts.append(r.source)
        if config.get("autotune") and self.rendered:
            self._autotune(kernels)
            parts = [PRELUDE] + [self.sources[k.name] for k in kernels]
        if any(isinstance(r, TritonTableSource) for r in self.rendered.values()):
            parts.append(TABLE_FILL_SOURCE)  # writes a table during a CUDA graph's capture
        source = "\n\n".join(parts) + "\n"
        self.full_source = source
        if not kernels:
            return {}
        clock("build_render_s")
        module = self._module_of(source)  # imported where a kernel's function is used (kernel_module.py)
        clock("build_module_file_s")
        fns = {k.name: module.function(k.name) for k in kernels}
        namespace = {"triton": triton, "_stream": current_stream, **fns}
        # The 64-bit forms of symbolic kernels, launched through kernel[grid] past their guard.
        wide = [n for n, r in self.rendered.items() if getattr(r, "guard", ())]
        namespace.update({f"{n}_wide": module.function(f"{n}_wide") for n in wide})
        # A compiled kernel is loaded on the device current at compile time: launch it directly
        # only on that device (Triton's own path looks up the current device per call).
        index = _device_index(self.device)
        direct = config.get("direct_launch") and index is not None and index == _current_device()
        gemm_fns = {n: fns.pop(n) for n in self.gemm_kernels}
        namespace.update(gemm_fns)
        jobs = _warmup_jobs(fns, self.rendered)
        base = kernel_dedup.key_base(PRELUDE, self._target.key(), triton_identity())

        def key_of(job: tuple) -> str:  # its normalized source and specialization (kernel_dedup.py)
            return kernel_dedup.kernel_key(self.sources[job[0]], job[2:], base)

        if self._target.interpreted:  # Triton's interpreter compiles nothing: equal kernels share one function
            for job in jobs:
                name, key = job[0], key_of(job)
                shared = SHARED.get(key, None)
                if shared is None:
                    stats.add("kernels_compiled")
                    shared = SHARED.put(key, None, kernel_dedup.Launchable(function=fns[name].resolve()))
                namespace[name] = shared.function
            self._table_launches(module, namespace)
            return namespace
        precompile_gemms(self.gemm_kernels, gemm_fns)
        clock("build_gemm_compile_s")
        # A warm start loads each static kernel from its launch record, without Triton.
        records = LaunchRecords(module.key, [j[:1] + j[2:] for j in jobs], self._target.key()) if direct else None
        recorded = records.load() if records is not None else {}
        for name, record in recorded.items():
            static = static_launch.from_record(record, index) if name in fns else None
            if static is not None:
                self.static[name] = static
        jobs = [j for j in jobs if j[0] not in self.static]
        clock("build_kernel_load_s")
        keys = {j[0]: key_of(j) for j in jobs}  # only the kernels left to compile or find
        self._compile_distinct(jobs, keys, module, index if direct else None, namespace)
        clock("build_compile_s")
        if self.static:
            namespace["_static_launch"] = next(iter(self.static.values())).launch
        self._table_launches(module, namespace)
        if module.loaded:  # imported by now: the host program calls the functions themselves, not stand-ins
            namespace.update({n: f.resolve() for n, f in namespace.items() if isinstance(f, KernelFunction)})
        if records is not None and jobs and len(recorded) < len(self.static):
            records.save({name: s.record for name, s in self.static.items()})
        return namespace

    def _table_launches(self, kernel_module: KernelModule, namespace: dict) -> None:
        """A TableLaunch (backends/table_launch.py) per table combo kernel, as `_tables_<name>`,
        launching the kernel the way the others are (static, Triton's launcher, or kernel[grid]),
        and its form for unaligned buffers and the table-writing kernel through kernel[grid] (the
        latter loaded now: a capture may launch it, and must not load a binary)."""
        tables = {n: r for n, r in self.rendered.items() if isinstance(r, TritonTableSource)}
        if not tables:
            return
        module = kernel_module.load()
        fp_fusion = _fp_fusion()
        device = self.device if self.device is not None else torch.device("cpu")
        writer = module.ember_table_fill
        fill_options = {"num_warps": 1, "enable_fp_fusion": fp_fusion}  # warmed with the launch's own: one cache key
        if not self._target.interpreted:
            launch_handles(writer.warmup(torch.int64, *[TABLE_FILL_BIAS] * TABLE_FILL_ARGS, grid=(1,), **fill_options))

        def fill(out, values):
            writer[(1,)](out, *values, **fill_options)

        for name, r in tables.items():
            blocks, xblock, warps = r.blocks, r.launch.xblock, r.launch.num_warps
            slow = _grid_launch(getattr(module, f"{name}_any"), blocks, xblock, warps, fp_fusion)
            if name in self.static:
                fast = _static_table_launch(self.static[name], blocks)
            elif name in self.direct:
                handles = (namespace[f"{name}_run"], namespace[f"{name}_fn"], namespace[f"{name}_meta"])
                fast = _direct_table_launch(handles, blocks, xblock)
            else:
                on_grid = _grid_launch(namespace[name], blocks, xblock, warps, fp_fusion)
                fast = lambda stream, *tables, on_grid=on_grid: on_grid(*tables)
            namespace[f"_tables_{name}"] = TableLaunch(r, device, fast, slow, fill)

    def _compile_distinct(
        self, jobs: list[tuple], keys: dict[str, str], module: KernelModule, device: int | None, namespace
    ) -> None:
        """Compile each distinct kernel of `jobs` once (backends/kernel_dedup.py) and make every
        kernel launchable directly on `device` (None: launched through `kernel[grid]`, so every
        kernel is warmed up in its own function, and nothing is shared)."""
        if device is None:
            self._precompile(jobs, module)
            stats.add("kernels_compiled", len(jobs))
            return
        found: dict[str, kernel_dedup.Launchable] = {}
        first: dict[str, str] = {}  # key -> the kernel of this graph compiled for it
        distinct = []
        for job in jobs:
            name, key = job[0], keys[job[0]]
            shared = SHARED.get(key, device) or (SHARED.load_record(key, device) if key not in first else None)
            if shared is not None:
                found[name] = shared
            elif key not in first:
                first[key] = name
                distinct.append(job)
        for name, compiled in self._precompile(distinct, module).items():
            stats.add("kernels_compiled")
            static = static_launch.from_compiled(compiled, device)
            if static is not None:
                kernel_dedup.Shared.save_record(keys[name], static.record)
            launchable = kernel_dedup.Launchable(static=static, handles=None if static else launch_handles(compiled))
            found[name] = SHARED.put(keys[name], device, launchable)
        for job in jobs:
            name = job[0]
            shared = found.get(name)
            if shared is None:  # a duplicate within this graph
                shared = SHARED.get(keys[name], device)
            if shared is None:
                continue  # its first copy did not compile ahead: it compiles at its first launch
            if shared.static is not None:
                self.static[name] = shared.static
            elif shared.handles is not None:
                self.direct.add(name)
                run, fn, meta = shared.handles
                namespace.update({f"{name}_run": run, f"{name}_fn": fn, f"{name}_meta": meta})

    def _tuning(self) -> tuple[Timer, Budget] | None:
        """The timer and the budget of this graph's tuning, made at first use; None without autotune."""
        if not config.get("autotune"):
            return None
        if self._budget is None:
            self._timer = self._timer or make_timer(self.device, self._target)
            self._budget = Budget.from_settings(self._timer, time.perf_counter() - self._created)
        return self._timer, self._budget

    def _autotune(self, kernels: list[Kernel]) -> None:
        """Each static kernel's launch by measurement (backends/launch_tuning.py), within the budget."""
        timer, budget = self._tuning()
        tuned = tune_launches(kernels, self.rendered, self._target, self.device, self._load, timer, budget)
        for name, r in tuned.items():
            self.rendered[name] = r
            self.sources[name] = r.source

    def _precompile(self, jobs: list[tuple], module: KernelModule) -> dict[str, object]:
        """Compile the kernels of `jobs` (`_warmup_jobs`) now, in parallel threads, instead of one
        by one at first launch.

        MLIR passes and ptxas do not hold the GIL, but Triton's front end does: a large graph's
        kernels go to the compile workers first, and each thread then loads a kernel from Triton's
        cache as soon as its worker is done. Returns each kernel's compiled form. `module`: the
        kernels' module, which the workers import from its file.
        """
        if not jobs:
            return {}
        first, rest = jobs[0], jobs[1:]
        threads = min(config.get("compile_threads"), len(rest))
        workers, ready_only = self._workers(len(rest)) if threads else (None, False)
        if workers is None:
            compiled = {first[0]: _warmup(*first[1:])}  # first alone: Triton sets up per-device state once
            if threads:
                with ThreadPoolExecutor(threads) as pool:
                    futures = {job[0]: pool.submit(_warmup, *job[1:]) for job in rest}
                    compiled.update({name: future.result() for name, future in futures.items()})
            return compiled
        compiled = compile_workers.compile_beside(workers, first, rest, module.load(), ready_only, threads, _warmup)
        if workers.failures:
            log.artifact("cache", "compile workers", "\n".join(workers.failures))
        return compiled

    def _workers(self, kernels: int) -> tuple[object | None, bool]:
        """The compile workers for `kernels` kernels, and whether only those ready now serve: ready
        ones serve any graph; a graph of WORKERS_FROM_KERNELS or more starts them and waits. None
        where this module was compiled before (its kernels are most likely in Triton's cache)."""
        if self._module_seen or config.get("compile_workers") < 2:
            return None, False
        if kernels >= WORKERS_FROM_KERNELS:
            return compile_workers.get(config.get("compile_workers"), self._target.arch), False
        running = compile_workers.started(self._target.arch)
        if running is not None and running.ready_count() >= 2:
            return running, True
        return None, False

    def _module_of(self, source: str) -> KernelModule:
        """The graph's kernel module, in ember's cache, not yet imported."""
        module = KernelModule(source)
        self._module_seen = module.seen
        return module

    def _load(self, source: str):
        """Triton source -> its imported module (the tuners' candidates, and layers.py's reading of a graph's)."""
        return KernelModule(source).load()

    def prologue(self) -> list[str]:
        return [f"stream = _stream({_device_index(self.device)})"] if self.direct or self.static else []

    def launch_line(self, kernel: Kernel, args: dict) -> str:
        name = kernel.name
        if name in self.gemm_kernels:
            return self.gemm_kernels[name].launch_line(args["buffers"])
        r = self.rendered[name]
        if isinstance(r, TritonTableSource):
            stream = "stream" if name in self.static or name in self.direct else "None"
            # Each tensor once (an in-place output is its input): the launch reads every address per call.
            distinct = {b: k for k, b in enumerate(dict.fromkeys(args["same"]))}
            slots = tuple(distinct[b] for b in args["same"])
            return f"_tables_{name}({stream}, {slots}, {', '.join(distinct)})"
        line, slow = self._launch(r, name, args)
        guard = getattr(r, "guard", ())
        if not guard:
            return line
        # 32-bit index math while every extent the kernel indexes is small enough (one comparison
        # each, per call), else its 64-bit form through kernel[grid] (codegen/triton.py: narrow_guard).
        limit = self._target.heuristics.launch.symbolic_int32_below
        small = " and ".join(f"{print_host_index(e)} < {limit}" for e in guard)
        wide = slow.replace(f"{name}[", f"{name}_wide[", 1)
        return f"({line}) if {small} else {wide}"

    def _launch(self, r, name: str, args: dict) -> tuple[str, str]:
        """The launch statement of rendered kernel `r`, and its `kernel[grid]` form."""
        bufs = iter(args["buffers"])
        parts = [next(bufs) if p.kind == "buffer" else print_host_index(p.value) for p in r.params]
        xnumel = print_host_index(r.xnumel)
        parts.append(xnumel)
        consts = {"XBLOCK": r.launch.xblock}
        if r.launch.rblock:
            parts.append(print_host_index(r.rnumel))
            consts["RBLOCK"] = r.launch.rblock
        per_program = r.launch.rows_per_program or r.launch.xblock
        grid = f"triton.cdiv({xnumel}, {per_program})"
        keywords = ", ".join(f"{k}={v}" for k, v in consts.items())
        options = ", ".join(f"{k}={v}" for k, v in KERNEL_OPTIONS.items())
        warps = r.launch.num_warps
        slow = f"{name}[({grid},)]({', '.join(parts)}, {keywords}, num_warps={warps}, enable_fp_fusion={_fp_fusion()}, {options})"
        if name not in self.static and name not in self.direct:
            return slow, slow
        # Every parameter in order; the grid a number where the sizes are static, else computed per
        # call from the bound size symbols (one program at least: a grid of 0 is a launch error).
        xsize = sympy.sympify(r.xnumel)
        blocks = -(-int(xsize) // per_program) if xsize.is_Integer else f"max(1, -(-({xnumel}) // {per_program}))"
        every = parts + [str(v) for v in consts.values()]
        if name in self.static:
            direct = self.static[name].line(blocks, every)
        else:
            # Triton's launcher takes every parameter in order, constexprs included, after grid,
            # stream, function, packed metadata, launch metadata and the enter/exit hooks.
            direct = f"{name}_run({blocks}, 1, 1, stream, {name}_fn, {name}_meta, None, None, None, {', '.join(every)})"
        unaligned = args["maybe_unaligned"]
        if not unaligned:
            return direct, slow
        check = " | ".join(f"{b}.data_ptr()" for b in unaligned)
        return f"{slow} if ({check}) & 15 else {direct}", slow


class _BuildClock:
    """Adds the seconds since its previous call to an ember.stats counter (`ember bench --compile-time`)."""

    def __init__(self):
        self.last = time.perf_counter()

    def __call__(self, counter: str) -> None:
        now = time.perf_counter()
        stats.add(counter, now - self.last)
        self.last = now


def _fp_fusion() -> bool:
    """Whether Triton may contract a*b + c into one FMA (setting `fp_contract`). On, a value the
    schedule computes in two places (a product inside a reduction and again after it, as in layer
    norm's backward) may round differently in each: `g*w - mean(g*w)` over a one-element row is
    2.3e-5 after the 316x of its rstd, where eager gives 0 (OpInfo layer_norm on the H100). Off,
    cross_entropy over 50257 classes ran 5% slower (0.650 vs 0.618 ms; its row loop is close to
    compute-bound). The C++ backend builds with -std=c++17, which does not contract."""
    return bool(config.get("fp_contract"))


def _warmup_jobs(fns: dict, rendered: dict[str, TritonKernelSource]) -> list[tuple]:
    """(name, fn, args, constants, warps, contraction) for Triton's `warmup` of each kernel.

    `warmup` compiles for given argument types without launching: buffers are passed as dtypes
    (aligned mock pointers, as fresh allocations are) and static sizes as their values, so the
    specialization matches the real launch. A symbolic size is passed as a stand-in (`_stand_in`)
    that gives the binary only what holds for every value the size can take, so that one binary,
    launched directly, serves every call: `kernel[grid]` would bind and specialize the arguments
    again on each call (18.7 us of host time against 6.5 on the H100 machine)."""
    jobs = []
    fp_fusion = _fp_fusion()  # read here: the settings in force are this thread's
    for name, fn in fns.items():
        r = rendered[name]
        if isinstance(r, TritonTableSource):  # the address table (int64s), the heads and each block's part
            args = [torch.int64, torch.int32, torch.int32]
            jobs.append((name, fn, args, {"XBLOCK": r.launch.xblock}, r.launch.num_warps, fp_fusion))
            continue
        sizes = [p.value for p in r.params if p.kind == "size"] + [r.xnumel] + ([r.rnumel] if r.launch.rblock else [])
        narrow = bool(getattr(r, "guard", ()))
        args = [p.value.dtype for p in r.params if p.kind == "buffer"] + [_stand_in(x, narrow) for x in sizes]
        consts = {"XBLOCK": r.launch.xblock, **({"RBLOCK": r.launch.rblock} if r.launch.rblock else {})}
        jobs.append((name, fn, args, consts, r.launch.num_warps, fp_fusion))
    return jobs


def _stand_in(size, narrow: bool = False) -> int:
    """The value `warmup` specializes a size parameter for: a static size's own; for a symbolic one,
    a value that is not 1 (Triton makes a 1 a constant), divisible by 16 exactly where the expression
    is for every value of its symbols (`768*s0` is, `s0` is not: Triton assumes that divisibility in
    the binary), and 32-bit for a kernel's 32-bit form (`narrow`: launched only while its extents fit,
    codegen/triton.py: narrow_guard), else 64-bit, so no later size overflows the parameter's type."""
    size = sympy.sympify(size)
    if size.is_Integer:
        return int(size)
    big = 1 << 30 if narrow else 1 << 32
    return big if sympy.Mod(size, 16) == 0 else big + 1


def _check_can_run(device) -> None:
    """Triton compiles for a GPU; on other tensors it runs only through its CPU interpreter. Said
    here, where it would otherwise fail deep inside Triton ("0 active drivers")."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise config.ConfigError("backend=triton needs the triton package (pip install triton)") from None
    if (device is None or device.type != "cuda") and not interpreting():
        raise config.ConfigError(
            f"backend=triton needs a CUDA GPU, and this graph's tensors are on {device or 'the CPU'}: use "
            "backend=cpp (EMBER_BACKEND=cpp) for the CPU, or set TRITON_INTERPRET=1 for Triton's CPU "
            "interpreter (slow)"
        )


def _interpret_as_compiled() -> None:
    """Triton's interpreter runs kernels with the options ember compiles them with (KERNEL_OPTIONS). It takes
    no compile options of its own and recomputes every 32-bit integer add, subtract and multiply in 64 bits
    for an overflow check (asserted in debug mode only): half of the interpreter's time in a FlexAttention
    backward, for a check ember's compiled kernels never make. The interpreter's options are the process's:
    from the first graph ember builds for it on, every kernel it runs, the user's own too, runs without the
    check."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not dataclasses.is_dataclass(options):
        return
    names = {f.name for f in dataclasses.fields(options)}
    wanted = {k: v for k, v in KERNEL_OPTIONS.items() if k in names and getattr(options, k) != v}
    if wanted:
        builder.options = dataclasses.replace(options, **wanted)


def start_compile_workers(device: torch.device) -> None:
    """Start the compile workers (compile_workers.py) for `device`'s GPU now, where the setting
    `compile_workers_early` asks: called when a graph arrives, so that they import while AOTAutograd
    traces and ember schedules, and are ready when its kernels are. Nothing on other devices, under
    Triton's interpreter, or where another backend is chosen."""
    if (
        device.type != "cuda"
        or config.get("backend") not in ("auto", "triton")
        or not config.get("compile_workers_early")
    ):
        return
    if interpreting():
        return
    compile_workers.get(config.get("compile_workers"), gpu_arch())


def _grid_launch(fn, blocks: int, xblock: int, warps: int, fp_fusion: bool) -> Callable:
    """A table combo kernel's launch through kernel[grid], given its tables."""

    def launch(*tables):
        fn[(blocks,)](*tables, XBLOCK=xblock, num_warps=warps, enable_fp_fusion=fp_fusion)

    return launch


def _static_table_launch(static: StaticLaunch, blocks: int) -> Callable:
    def launch(stream, *tables):
        static.run(blocks, tuple(t.data_ptr() for t in tables), stream)

    return launch


def _direct_table_launch(handles: tuple, blocks: int, xblock: int) -> Callable:
    """Through Triton's own launcher: every parameter in order, the constexpr XBLOCK included."""
    run, fn, meta = handles

    def launch(stream, *tables):
        run(blocks, 1, 1, stream, fn, meta, None, None, None, *tables, xblock)

    return launch


def _warmup(fn, args, consts, num_warps, fp_fusion):
    return fn.warmup(*args, grid=(1,), num_warps=num_warps, enable_fp_fusion=fp_fusion, **KERNEL_OPTIONS, **consts)


def launch_handles(compiled) -> tuple | None:
    """(launcher, CUfunction, packed metadata) of a compiled kernel, loading it on the device
    now; None where this Triton's CompiledKernel does not expose them (then kernel[grid] it is)."""
    try:
        run = compiled.run  # loads the binary (_init_handles)
        return run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return None


def _device_index(device) -> int | None:
    return None if device is None or device.type != "cuda" else (device.index or 0)


def _current_device() -> int | None:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else None


def current_stream(index: int) -> int:
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object per call
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
