"""A graph's Triton kernel module: its file in the content cache now, its import at first use.

Importing the module runs `@triton.jit` over every kernel in it, which reads each function's
source back and parses its signature: about a millisecond a kernel, a third of a second for the
forward and backward of a 12-layer GPT-2 on the H200 machine's host. A warm start needs none of
it: each kernel launches from its launch record (static_launch.py), straight from the binary.
So the module is imported only when something reads a kernel's function: a kernel to compile, a
GEMM template or table kernel (which launch through their functions), or a host program taking a
kernel's `kernel[grid]` path at run time (a misaligned buffer, a symbolic kernel's 64-bit form).
"""

from __future__ import annotations

import re
import sys
import threading
from types import ModuleType

from ember import stats
from ember.runtime import scratch
from ember.runtime.cache import DiskCache, content_key, triton_identity


class KernelModule:
    """The kernel module of Triton source `source`, written to ember's disk cache (kind "triton")
    if it is not there, and imported from a private copy at the first `load()`."""

    def __init__(self, source: str):
        self.key = content_key("triton", source, toolchain=triton_identity())
        cache = DiskCache()
        entry = cache.get("triton", self.key)
        # Compiled before: Triton's own cache most likely holds its kernels.
        self.seen = entry is not None
        self._data = (entry or cache.put("triton", self.key, {"kernels.py": source.encode()}))["kernels.py"]
        self._module: ModuleType | None = None
        self._names: frozenset[str] | None = None  # the functions its source defines, read at the first `function()`
        self._lock = threading.Lock()  # GEMM templates compile in threads, each reading its function

    @property
    def loaded(self) -> bool:
        return self._module is not None

    def load(self) -> ModuleType:
        with self._lock:
            if self._module is None:
                name = f"ember_kernels_{self.key[:16]}"
                fresh = name not in sys.modules  # not where another graph of the same source imported it
                self._module = scratch.import_private_copy(self._data, name)
                if fresh:
                    stats.add("kernel_modules_imported")
        return self._module

    def function(self, name: str) -> KernelFunction:
        """Kernel `name`'s `@triton.jit` function, imported when first used. A name the module does not
        define is an error now, not at the call that first takes its path."""
        if self._names is None:
            self._names = frozenset(m.decode() for m in re.findall(rb"^def (\w+)\(", self._data, re.MULTILINE))
        if name not in self._names:
            raise KeyError(f"the kernel module {self.key[:16]} defines no function {name}")
        return KernelFunction(self, name)


class KernelFunction:
    """A kernel's `@triton.jit` function in a KernelModule, standing in for it until it is used:
    `kernel[grid](...)` and attribute reads (`warmup`, ...) import the module and forward."""

    __slots__ = ("_function", "_module", "name")

    def __init__(self, module: KernelModule, name: str):
        self._module = module
        self.name = name
        self._function = None

    def resolve(self):
        if self._function is None:
            self._function = getattr(self._module.load(), self.name)
        return self._function

    def __getitem__(self, grid):
        return (self._function or self.resolve())[grid]

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # copy's and other probes' dunders, and slots not yet set: not the kernel's
            raise AttributeError(attr)
        return getattr(self.resolve(), attr)

    def __repr__(self) -> str:
        state = "imported" if self._module.loaded else "not imported"
        return f"<kernel {self.name} of module {self._module.key[:16]} ({state})>"
