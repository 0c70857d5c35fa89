"""`EMBER_LOGS=recompiles`: why each recompile happened, in Dynamo's words and in ember's.

Dynamo compiles a frame again when none of its compiled versions' guards pass (a new shape, dtype,
a changed global). Its reason, the first failing guard of the latest version (what
`TORCH_LOGS=recompiles` prints), is in the metrics of the compile in progress
(`torch._dynamo.utils.get_metrics_context()`, "recompile_reason"), and the compile's id says which
frame and which of its versions this is (`[frame/version]`). ember adds what the recompile could
reuse: per graph whether its schedule came from a cache (ember's schedule cache, AOTAutograd's),
and how many kernels were compiled against how many were found compiled already (ember/stats.py:
kernels shared in this process or loaded from the disk cache; C++ libraries built).

A first compile of a frame logs nothing: there is nothing to explain.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ember import log, stats
from ember.report import collecting


def dynamo_reason() -> tuple[str, str] | None:
    """(Dynamo's compile id as `[frame/version]`, its recompile reason) when the compile in progress
    is a recompile; None for a frame's first compile, or where this torch does not say."""
    try:
        from torch._dynamo.utils import get_metrics_context
        from torch._guards import CompileContext
    except ImportError:
        return None
    compile_id = CompileContext.current_compile_id()
    metrics = getattr(get_metrics_context(), "_metrics", None) or {}
    reason = metrics.get("recompile_reason")
    if not reason and (compile_id is None or not getattr(compile_id, "frame_compile_id", 0)):
        return None
    where = f"[{compile_id.frame_id}/{compile_id.frame_compile_id}]" if compile_id is not None else "[?]"
    return where, reason or "Dynamo gave no reason"


def ember_reuse(graphs: list, counted: dict) -> str:
    """What ember reused for the graphs of one recompile, in a line."""
    parts = []
    for g in graphs:
        if g.fallback:
            parts.append(f"{g.kind}: ran eagerly ({g.fallback[:120]})")
        elif "cached schedule" in g.stage_seconds:
            parts.append(f"{g.kind}: schedule reused from the cache, {len(g.kernels)} kernels")
        else:
            parts.append(f"{g.kind}: scheduled anew, {len(g.kernels)} kernels")
    compiled = int(counted.get("kernels_compiled", 0))
    shared = int(counted.get("kernel_dedup_hits", 0) + counted.get("kernel_dedup_disk_hits", 0))
    kernels = f"kernels: {compiled} compiled, {shared} reused from earlier compiles"
    if counted.get("cpp_builds"):
        kernels += f", {int(counted['cpp_builds'])} C++ libraries built"
    return "; ".join(parts + [kernels])


@contextlib.contextmanager
def explained() -> Iterator[None]:
    """Around one call of ember's backend: under `EMBER_LOGS=recompiles`, a recompile logs Dynamo's
    reason and, once compiled, what ember reused (module docstring)."""
    found = dynamo_reason() if log.enabled("recompiles") else None
    if found is None:
        yield
        return
    where, reason = found
    before = stats.snapshot()
    with collecting() as report:
        yield
    reuse = ember_reuse(report.graphs, stats.delta(before))
    log.artifact("recompiles", f"recompile {where}", f"Dynamo: {reason}\nember: {reuse}")
