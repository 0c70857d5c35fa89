"""GPU backend: one Triton kernel per fused group, all of a graph's kernels in one module.

Stages: render (Triton source) -> module file in the content cache -> import -> Triton's
own stages (ttir -> ttgir -> llir -> ptx -> cubin), which Triton caches on disk by source.
The kernels of a graph are compiled ahead of the first call, in parallel threads (Triton
spends most of that time in MLIR passes and ptxas, outside the GIL).
"""

from __future__ import annotations

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import sympy

from ember import config
from ember.codegen.render import print_index
from ember.codegen.triton import PRELUDE, TritonKernelSource, render_triton
from ember.runtime.cache import DiskCache, content_key
from ember.schedule.kernel import Kernel


class TritonBackend:
    name = "triton"

    def __init__(self):
        self.rendered: dict[str, TritonKernelSource] = {}
        self.sources: dict[str, str] = {}

    def build(self, kernels: list[Kernel]) -> dict[str, object]:
        import triton

        parts = [PRELUDE]
        for k in kernels:
            r = render_triton(k)
            self.rendered[k.name] = r
            self.sources[k.name] = r.source
            parts.append(r.source)
        source = "\n\n".join(parts) + "\n"
        self.full_source = source
        if not kernels:
            return {}
        module = self._load(source)
        fns = {k.name: getattr(module, k.name) for k in kernels}
        self._precompile(fns)
        return {"triton": triton, **fns}

    def _precompile(self, fns: dict) -> None:
        """Compile every kernel now, in parallel threads, instead of one by one at first launch.

        Triton's `warmup` compiles for given argument types without launching: buffers are
        passed as dtypes (aligned mock pointers, as fresh allocations are) and sizes as their
        static values, so the specialization matches the real launch. Kernels with symbolic
        sizes compile at first launch instead. Triton spends most of a compile in MLIR passes
        and ptxas, which do not hold the GIL.
        """
        import os

        if os.environ.get("TRITON_INTERPRET") == "1":
            return
        jobs = []
        for name, fn in fns.items():
            r = self.rendered[name]
            sizes = (
                [p.value for p in r.params if p.kind == "size"] + [r.xnumel] + ([r.rnumel] if r.launch.rblock else [])
            )
            if any(not sympy.sympify(x).is_Integer for x in sizes):
                continue
            args = [p.value.dtype for p in r.params if p.kind == "buffer"] + [int(x) for x in sizes]
            consts = {"XBLOCK": r.launch.xblock, **({"RBLOCK": r.launch.rblock} if r.launch.rblock else {})}
            jobs.append((fn, args, consts, r.launch.num_warps))
        if not jobs:
            return
        _warmup(*jobs[0])  # first alone: Triton sets up its per-device state once, unraced
        threads = min(config.get("compile_threads"), len(jobs) - 1)
        if threads:
            with ThreadPoolExecutor(threads) as pool:
                for future in [pool.submit(_warmup, *job) for job in jobs[1:]]:
                    future.result()

    def _load(self, source: str):
        import triton

        key = content_key("triton", source, triton.__version__)
        cache = DiskCache()
        entry = cache.get("triton", key) or cache.put("triton", key, {"kernels.py": source.encode()})
        path = Path(entry) / "kernels.py"
        name = f"ember_kernels_{key[:16]}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    def launch_line(self, kernel: Kernel, args: dict) -> str:
        r = self.rendered[kernel.name]
        bufs = iter(args["buffers"])
        parts = [next(bufs) if p.kind == "buffer" else print_index(p.value, "//") for p in r.params]
        xnumel = print_index(r.xnumel, "//")
        parts.append(xnumel)
        consts = [f"XBLOCK={r.launch.xblock}"]
        if r.launch.rblock:
            parts.append(print_index(r.rnumel, "//"))
            consts.append(f"RBLOCK={r.launch.rblock}")
        grid = f"(triton.cdiv({xnumel}, {r.launch.xblock}),)"
        return f"{kernel.name}[{grid}]({', '.join(parts + consts)}, num_warps={r.launch.num_warps})"


def _warmup(fn, args, consts, num_warps) -> None:
    fn.warmup(*args, grid=(1,), num_warps=num_warps, **consts)
