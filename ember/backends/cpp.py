"""CPU backend: all kernels of a graph in one C++ translation unit, one compiler run, one .so.

Stages: render (C++ source) -> compile (g++ -> shared library) -> load (ctypes). The
compiler's identity, the flags and the host CPU (we build with -march=native) enter the
cache key, so a cached library is never loaded on a machine it was not built for.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import subprocess
import tempfile
from pathlib import Path

from ember import config
from ember.codegen.cpp import PRELUDE, render_cpp
from ember.codegen.render import print_index
from ember.runtime.cache import DiskCache, content_key
from ember.schedule.kernel import Kernel

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-fno-trapping-math"]


class ToolchainError(RuntimeError):
    """The C++ compiler is missing or rejected the generated source."""


@functools.lru_cache(maxsize=4)
def toolchain_identity(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"C++ compiler {cxx!r} is not usable: {e}") from None
    return out.splitlines()[0] if out else cxx


@functools.lru_cache(maxsize=1)
def _host_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CppBackend:
    name = "cpp"

    def __init__(self):
        self.cxx = config.get("cxx")
        self.sources: dict[str, str] = {}
        self.lib = None

    def build(self, kernels: list[Kernel]) -> dict[str, object]:
        """Compile all kernels; returns the host-program namespace entries (the callables)."""
        parts = [PRELUDE]
        self.params = {}
        for k in kernels:
            src, params = render_cpp(k)
            self.sources[k.name] = src
            self.params[k.name] = params
            parts.append(src)
        source = "\n\n".join(parts) + "\n"
        self.full_source = source
        if not kernels:
            return {}
        path = self._compile(source)
        self.lib = ctypes.CDLL(str(path))
        namespace = {}
        for k in kernels:
            fn = getattr(self.lib, k.name)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p if p.kind == "buffer" else ctypes.c_int64 for p in self.params[k.name]]
            namespace[k.name] = fn
        return namespace

    def _compile(self, source: str) -> Path:
        ident = toolchain_identity(self.cxx)
        key = content_key("cpp", source, ident, FLAGS, _host_cpu())
        cache = DiskCache()
        hit = cache.get("cpp", key)
        if hit is not None:
            return hit / "graph.so"
        with tempfile.TemporaryDirectory(prefix="ember-cpp-") as tmp:
            src = Path(tmp) / "graph.cpp"
            out = Path(tmp) / "graph.so"
            src.write_text(source)
            cmd = [self.cxx, *FLAGS, str(src), "-o", str(out)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            except (OSError, subprocess.SubprocessError) as e:
                raise ToolchainError(f"{self.cxx} failed to run: {e}") from None
            if proc.returncode != 0:
                raise ToolchainError(f"{self.cxx} exited {proc.returncode}: {proc.stderr.strip()[:2000]}")
            entry = cache.put("cpp", key, {"graph.cpp": source.encode(), "graph.so": out.read_bytes()})
        return entry / "graph.so"

    def launch_line(self, kernel: Kernel, args: dict) -> str:
        bufs = iter(args["buffers"])
        parts = []
        for p in self.params[kernel.name]:
            parts.append(f"{next(bufs)}.data_ptr()" if p.kind == "buffer" else print_index(p.value, "//"))
        return f"{kernel.name}({', '.join(parts)})"
