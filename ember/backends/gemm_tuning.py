"""cuBLAS (through ATen) or ember's GEMM template: chosen by measuring, cached on disk.

A stage of the Triton backend: `GemmTuning(target, device, load_module).choose` is its
`GemmChooser` (schedule/gemm.py), and `load_module` (the backend's own: Triton source -> a loaded
module) is how it compiles the tiles it times, so this module never imports the backend back.
The setting `gemm` decides who may win:

- `aten`: always ATen. `template`: always the template (on the GPU, the fastest of the
  candidate tiles; without a GPU to measure on, the tile `fit_config` picks by size).
- `auto`: on a CUDA device, the first time a (shape class, dtype, operand layouts, device) is
  seen, the ATen call and up to six template tiles pruned by shape are timed on random
  operands of that shape (the tiles compile in parallel threads; the whole measurement takes
  seconds). The timings go to the disk cache (kind "gemm"), keyed also by the template's own
  source file and the toolchain, so later compiles and processes read them instead. The
  template wins when its best time beats ATen's plus the round trip its fused epilogue saves
  (`epilogue_bytes` at the measured copy bandwidth). Without a GPU (the CPU interpreter),
  nothing is measured and `auto` means ATen.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import sympy
import torch

from ember import config, log
from ember.ir.sizes import pow2_ceil
from ember.runtime.cache import DiskCache, content_key
from ember.schedule.gemm import GemmChoice, GemmProblem, TileConfig
from ember.target import Target

MAX_CANDIDATES = 6
MAX_BATCH = 65535  # the template's batch runs on the grid's second axis

# Tiles that do well on Hopper/Ampere for bf16/fp16 without TMA or warp specialization,
# largest first; `candidates` clamps them to the problem and keeps the first few.
_HALF_TILES = (
    TileConfig(128, 256, 64, 8, 3, 8),
    TileConfig(256, 128, 64, 8, 3, 8),
    TileConfig(128, 128, 64, 8, 4, 8),
    TileConfig(128, 128, 64, 8, 3, 4),
    TileConfig(64, 128, 64, 8, 4, 4),
    TileConfig(128, 64, 64, 8, 4, 4),
    TileConfig(64, 64, 64, 8, 4, 4),
    TileConfig(32, 64, 64, 8, 4, 4),
)
# fp32 tiles hold twice the bytes per element: half the K depth.
_FLOAT_TILES = tuple(TileConfig(c.block_m, c.block_n, 32, c.group_m, c.num_stages, c.num_warps) for c in _HALF_TILES)

_memo: dict[str, dict] = {}
_lock = threading.Lock()


def _clamp(c: TileConfig, p: GemmProblem) -> TileConfig:
    """The tile shrunk to the problem (tl.dot wants every block dim >= 16)."""
    bm = min(c.block_m, max(16, pow2_ceil(p.m)))
    bn = min(c.block_n, max(16, pow2_ceil(p.n)))
    bk = min(c.block_k, max(16, pow2_ceil(p.k)))
    warps = c.num_warps if bm * bn >= 128 * 128 else min(c.num_warps, 4)
    return TileConfig(bm, bn, bk, c.group_m, c.num_stages, warps)


def candidates(p: GemmProblem, sms: int) -> list[TileConfig]:
    """Up to MAX_CANDIDATES tiles for this problem: clamped, deduplicated, and ordered so that
    tiles leaving most SMs idle come last (a 128x256 tile on a 512x512 output runs 8 programs)."""
    tiles = _FLOAT_TILES if p.dtype == torch.float32 else _HALF_TILES
    out: list[TileConfig] = []
    for c in tiles:
        c = _clamp(c, p)
        if c not in out:
            out.append(c)

    def programs(c: TileConfig) -> int:
        return p.batch * -(-p.m // c.block_m) * -(-p.n // c.block_n)

    out.sort(key=lambda c: programs(c) < sms)  # stable: keeps the size order within each class
    return out[:MAX_CANDIDATES]


def fit_config(p: GemmProblem) -> TileConfig:
    """A tile by size alone, for runs that cannot measure (the CPU interpreter)."""
    return TileConfig(
        min(64, max(16, pow2_ceil(p.m))), min(64, max(16, pow2_ceil(p.n))), min(32, max(16, pow2_ceil(p.k))), 8, 1, 4
    )


class GemmTuning:
    """The Triton backend's choice between its GEMM template and ATen, per matrix product.

    `target`: the device's Target (its SM count orders the tiles, its bandwidth prices the
    epilogue's round trip; an interpreted target measures nothing). `load_module`: Triton source
    -> its loaded module, as the backend loads its kernels (through ember's cache)."""

    def __init__(
        self,
        target: Target,
        device: torch.device | None,
        load_module: Callable[[str], ModuleType],
        tuning: Callable[[], tuple | None] | None = None,
    ):
        self.target, self.device, self.load_module = target, device, load_module
        # () -> (Timer, Budget) of the graph's tuning (backends/launch_tuning.py), or None: no bound
        # on measuring (gemm=auto set alone).
        self.tuning = tuning

    def choose(self, problem: GemmProblem, epilogue_bytes: int) -> GemmChoice:
        mode = config.get("gemm")
        if mode == "aten":
            return GemmChoice(False, None, "ATen: gemm=aten")
        if problem.batch > MAX_BATCH:
            return GemmChoice(False, None, f"ATen: batch {problem.batch} > {MAX_BATCH} (the template's grid)")
        if self.device is None or self.device.type != "cuda" or self.target.interpreted:
            if mode == "template":
                c = fit_config(problem)
                return GemmChoice(True, c, f"GEMM template (gemm=template; tile {c} by size: nothing to measure on)")
            return GemmChoice(False, None, "ATen: gemm=auto measures only on a GPU (gemm=template forces the template)")
        timings = measure(problem, self.device, self.target, self.load_module, self.tuning)
        if timings is None:
            if mode == "template":
                c = fit_config(problem)
                return GemmChoice(True, c, f"GEMM template (gemm=template; tile {c} by size: tuning's budget spent)")
            return GemmChoice(False, None, "ATen: the graph's tuning budget was spent before this shape was measured")
        tried = [(TileConfig(*c), t) for c, t in timings["configs"] if t is not None]
        if not tried:
            return GemmChoice(False, None, "ATen: no template tile compiled for this problem")
        best, t_best = min(tried, key=lambda ct: ct[1])
        t_aten = timings["aten"]
        perf = f"template {best} {t_best * 1e3:.3f} ms ({problem.flops / t_best / 1e12:.0f} TFLOP/s)"
        if mode == "template":
            return GemmChoice(True, best, f"GEMM template (gemm=template): {perf}")
        t_epilogue = epilogue_bytes / self.target.bandwidth
        versus = f"ATen {t_aten * 1e3:.3f} ms + epilogue round trip {t_epilogue * 1e3:.3f} ms"
        if t_best <= t_aten + t_epilogue:
            return GemmChoice(True, best, f"GEMM template, measured: {perf} vs {versus}")
        return GemmChoice(False, None, f"ATen, measured: {versus} vs {perf}")


def _cache_key(problem: GemmProblem, target: Target) -> str:
    import triton

    from ember.codegen import gemm_triton

    template = Path(gemm_triton.__file__).read_bytes()  # a changed template is measured again
    return content_key(
        "gemm-timings",
        problem.shape_class(),
        str(problem.dtype),
        problem.a_layout,
        problem.b_layout,
        target.device_name,
        torch.__version__,
        torch.version.cuda,
        triton.__version__,
        template,
        [str(c) for c in candidates(problem, target.sm_count)],
        target=target.key(),
    )


def measure(
    problem: GemmProblem,
    device: torch.device,
    target: Target,
    load_module: Callable[[str], ModuleType],
    tuning: Callable[[], tuple | None] | None = None,
) -> dict | None:
    """{"aten": seconds, "configs": [[tile fields, seconds or None], ...]}: from memory, the disk
    cache, or a fresh measurement (written to the cache). `tuning`: () -> (Timer, Budget) or None;
    with a budget, a fresh measurement starts only while some is left (else None) and is charged."""
    key = _cache_key(problem, target)
    with _lock:
        if key in _memo:
            return _memo[key]
        cache = DiskCache()
        entry = cache.get("gemm", key)
        if entry is not None:
            try:
                timings = json.loads(entry["timings.json"])
                _memo[key] = timings
                return timings
            except (KeyError, ValueError):
                pass
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        bound = tuning() if tuning is not None else None
        if bound is not None and bound[1].left(bound[0]) <= 0:
            return None
        start = time.perf_counter()
        with unset_fake_temporarily():  # compilers run under AOTAutograd's fake mode
            timings = _measure(problem, device, target, load_module)
        timings["seconds"] = time.perf_counter() - start
        if bound is not None:
            bound[1].charge(timings["seconds"], f"gemm {problem}")
        log.artifact("cache", "gemm", f"measured {problem} in {timings['seconds']:.2f} s: {timings}")
        if config.get("cache"):
            cache.put("gemm", key, {"timings.json": json.dumps(timings).encode()})
        _memo[key] = timings
        return timings


def operands(p: GemmProblem, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random operands of the problem's shape, dtype and layouts (a 'col' operand is a transpose)."""

    def make(rows: int, cols: int, layout: str) -> torch.Tensor:
        if layout == "col":
            t = torch.randn(p.batch, cols, rows, device=device, dtype=p.dtype).transpose(1, 2)
        else:
            t = torch.randn(p.batch, rows, cols, device=device, dtype=p.dtype)
        return t if p.batch > 1 else t[0]

    return make(p.m, p.k, p.a_layout), make(p.k, p.n, p.b_layout)


def bare_kernels(p: GemmProblem, a: torch.Tensor, b: torch.Tensor, configs: list[TileConfig], target: Target) -> list:
    """Template kernels computing just a @ b (no epilogue), one per tile, built through the same
    schedule and codegen path a compiled graph takes."""
    from ember.codegen.gemm_triton import render_gemm
    from ember.ir.graph import Graph
    from ember.ir.sizes import as_expr
    from ember.schedule.gemm import GemmOp, build_gemm_kernel
    from ember.schedule.kernel import Domain

    g = Graph(a.device)
    va = g.add_input([as_expr(s) for s in a.shape], a.dtype, [as_expr(s) for s in a.stride()])
    vb = g.add_input([as_expr(s) for s in b.shape], b.dtype, [as_expr(s) for s in b.stride()])
    batched = a.dim() == 3
    out_shape = (*a.shape[:-1], b.shape[-1])
    product = torch.ops.aten.bmm.default if batched else torch.ops.aten.mm.default
    attrs = {"target": product, "args": (va, vb), "kwargs": {}}
    node = g.add("extern", [va, vb], attrs, [([as_expr(s) for s in out_shape], a.dtype, None)], "mm")
    out = node.out
    zero = sympy.Integer(0)
    sa = tuple(va.stride) if batched else (zero, *va.stride)
    sb = tuple(vb.stride) if batched else (zero, *vb.stride)
    sources = []
    for i, c in enumerate(configs):
        op = GemmOp(
            node, va, vb, None, 1.0, 0.0, sa, sb, sympy.Integer(p.batch), *map(sympy.Integer, (p.m, p.n, p.k)), c, ""
        )
        kernel = build_gemm_kernel(f"gemm_tune_{i}", Domain(out.shape), 0, [out], [out], {out: 0}, op)
        sources.append(render_gemm(kernel, target, c))
    return sources


def grid(p: GemmProblem, c: TileConfig) -> tuple[int, int]:
    """The launch grid of a bare template kernel: one program per output tile, per batch."""
    return -(-p.m // c.block_m) * -(-p.n // c.block_n), p.batch


def _time(fn, budget: float = 0.02) -> float:
    """Seconds per call: CUDA events around enough calls to fill about `budget` seconds."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    reps = max(3, min(100, int(budget / once)))
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _measure(p: GemmProblem, device: torch.device, target: Target, load_module: Callable[[str], ModuleType]) -> dict:
    from ember.codegen.triton import PRELUDE

    torch.cuda.set_device(device)
    a, b = operands(p, device)
    aten = torch.bmm if a.dim() == 3 else torch.mm
    t_aten = _time(lambda: aten(a, b))
    configs = candidates(p, target.sm_count)
    sources = bare_kernels(p, a, b, configs, target)
    module = load_module("\n\n".join([PRELUDE] + [s.source for s in sources]) + "\n")
    out = torch.empty((*a.shape[:-1], b.shape[-1]), device=device, dtype=p.dtype)

    def compile_one(src):
        fn = getattr(module, src.kernel.name)
        args, consts = src.warmup_args()
        fn.warmup(*args, grid=(1,), **consts)
        return fn

    fns: list = [None] * len(sources)
    with ThreadPoolExecutor(min(len(sources), config.get("compile_threads"))) as pool:
        futures = [pool.submit(compile_one, s) for s in sources]
        for i, f in enumerate(futures):
            try:
                fns[i] = f.result()
            except Exception as e:  # noqa: BLE001 - a tile this GPU cannot hold (shared memory): not a candidate
                log.artifact("cache", "gemm", f"tile {configs[i]} did not compile: {type(e).__name__}: {e}"[:300])
    results = []
    for c, src, fn in zip(configs, sources, fns):
        t = None
        if fn is not None:
            sizes = [int(sympy.sympify(s)) for s in src.sizes()]

            def run(fn=fn, sizes=sizes, c=c, src=src):
                fn[grid(p, c)](a, b, out, *sizes, **src.constants(), num_warps=c.num_warps, num_stages=c.num_stages)

            try:
                run()
                torch.cuda.synchronize()
                if torch.allclose(out.float(), aten(a, b).float(), rtol=2e-2, atol=2e-2 * p.k**0.5):
                    t = _time(run)
                else:
                    log.artifact("cache", "gemm", f"tile {c} gave a wrong product: not a candidate")
            except Exception as e:  # noqa: BLE001 - a tile that fails to run is not a candidate
                log.artifact("cache", "gemm", f"tile {c} failed to run: {type(e).__name__}: {e}"[:300])
        results.append([list(dataclasses.astuple(c)), t])
    return {"aten": t_aten, "configs": results}


def precompile_gemms(sources: dict, fns: dict) -> None:
    """Compile a graph's template kernels ahead of the first call, in parallel threads (as the
    backend does for its other kernels); those with symbolic sizes compile at first launch. Not
    under Triton's interpreter, which compiles nothing."""
    if not sources:
        return
    jobs = [(fns[name], src.warmup_args()) for name, src in sources.items()]
    jobs = [(fn, w) for fn, w in jobs if w is not None]

    def compile_one(fn, warm):
        args, consts = warm
        fn.warmup(*args, grid=(1,), **consts)

    with ThreadPoolExecutor(max(1, min(config.get("compile_threads"), len(jobs)))) as pool:
        for future in [pool.submit(compile_one, fn, w) for fn, w in jobs]:
            future.result()
