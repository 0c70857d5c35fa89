"""Each distinct Triton kernel compiled once per process and once per disk cache.

A model of N identical layers gives N kernels per fused region that differ only in their names:
the kernel's own (`fk7`, `bk31`) and its parameters' (`in_v2`, `out_v8`: value numbers). Triton
keys its cache by the source, names included, so it compiles each copy, and the forward's kernel
again in the backward (a recomputed activation), and again in every other graph (a graph break,
another model). `kernel_key` hashes the source with every name a `def` line introduces (functions
and their parameters) renamed in order of appearance, so sources equal up to such renaming have one
key, together with what picks the binary: the warm-up specialization (argument dtypes, sizes,
constexprs, warps, contraction), the prelude of helper functions, the target's key, Triton's and
ember's identities (runtime/cache.py).

Renaming is consistent, one name for each name throughout the source, so equal keys mean equal
programs; the launch passes arguments by position, which the renaming keeps.

`Shared` is the process's memo: key and device -> the launchable form of the first kernel compiled
under it (torch's static launcher or Triton's own, backends/static_launch.py). Kernels found there,
or duplicated within the graph being built, are not compiled. On the disk, a kernel compiled for
the static launcher leaves its launch record under its key (kind `kernel`, which points at the
cubin entry): another module's kernel with the same key, in this process or a later one, loads
that binary without Triton. Under Triton's CPU interpreter nothing is compiled: kernels of one key
share the first one's function, so the keys are exercised (and counted) all the same.

Counters (ember/stats.py): `kernels_compiled`, `kernel_dedup_hits`, `kernel_dedup_disk_hits`.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

from ember import log, stats
from ember.runtime.cache import DiskCache, content_key

_DEF = re.compile(r"^[ \t]*def[ \t]+(\w+)[ \t]*\(([^)]*)\)", re.MULTILINE)


def normalized(source: str) -> str:
    """`source` with each function and parameter name its `def` lines introduce renamed, in order
    of first appearance, to `_f<n>` / `_a<n>`, everywhere it occurs as a whole word."""
    names: dict[str, str] = {}
    for m in _DEF.finditer(source):
        names.setdefault(m.group(1), f"_f{len(names)}")
        for param in m.group(2).split(","):
            name = param.split(":", 1)[0].split("=", 1)[0].strip()
            if name:
                names.setdefault(name, f"_a{len(names)}")
    if not names:
        return source
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")\b")
    return pattern.sub(lambda m: names[m.group(1)], source)


def kernel_key(source: str, specialization: tuple, base: tuple) -> str:
    """The key of one kernel: its normalized source, its warm-up specialization (the job's args,
    constexprs, warps, contraction) and `base` (`key_base`: what every kernel of a build shares)."""
    return content_key("kernel", normalized(source), specialization, base)


def key_base(prelude: str, target: tuple, toolchain: tuple) -> tuple:
    """What all kernels of one build share in their keys: the helpers they may call, the target's
    key, Triton's identity, and ember's (settings that change code, ember's source, versions)."""
    from ember.runtime.cache import ember_identity

    return (prelude, target, toolchain, ember_identity())


@dataclass(frozen=True)
class Launchable:
    """What a kernel compiled under a key gives every kernel of that key: its static launch
    (backends/static_launch.py), or Triton's launcher handles, or its interpreted function."""

    static: object = None  # a StaticLaunch
    handles: tuple | None = None  # (run, CUfunction, packed metadata) for Triton's launcher
    function: object = None  # the JITFunction, under Triton's interpreter


class Shared:
    """The process's compiled kernels by key and device (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple, Launchable] = {}

    def get(self, key: str, device: int | None) -> Launchable | None:
        with self._lock:
            found = self._by_key.get((key, device))
        if found is not None:
            stats.add("kernel_dedup_hits")
        return found

    def put(self, key: str, device: int | None, launchable: Launchable) -> Launchable:
        """Keep `launchable` under `key` (a kernel compiled once); the first one kept wins."""
        with self._lock:
            return self._by_key.setdefault((key, device), launchable)

    def load_record(self, key: str, device: int) -> Launchable | None:
        """A kernel of this key another module compiled for the static launcher, from its launch
        record in the disk cache; None where there is none, or it does not load now."""
        from ember.backends import static_launch

        entry = DiskCache().get("kernel", key)
        if entry is None:
            return None
        try:
            record = json.loads(entry["record.json"])
        except (KeyError, ValueError) as e:
            log.artifact("cache", "kernel record", f"{entry.path}: not read ({type(e).__name__})")
            return None
        static = static_launch.from_record(record, device)
        if static is None:
            return None
        stats.add("kernel_dedup_disk_hits")
        return self.put(key, device, Launchable(static=static))

    @staticmethod
    def save_record(key: str, record: dict) -> None:
        DiskCache().put("kernel", key, {"record.json": json.dumps(record, sort_keys=True).encode()})


SHARED = Shared()
