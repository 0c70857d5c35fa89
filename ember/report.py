"""Records of what ember did to each graph, collected by `ember.explain` and printed by EMBER_DEBUG."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class KernelReport:
    name: str
    ops: list[str]  # the ATen ops fused into it
    domain: str
    source: str
    bytes: int | None = None  # bytes moved if every buffer is touched once (None if symbolic)

    def __str__(self) -> str:
        moved = f", {self.bytes / 1e6:.2f} MB" if self.bytes is not None else ""
        return f"{self.name} over {self.domain}{moved}: {' + '.join(self.ops) or '(copy)'}"


@dataclass
class FusionReport:
    consumer: str
    producer: str
    accepted: bool
    reason: str


@dataclass
class GraphReport:
    kind: str  # "inference" | "forward" | "backward"
    backend: str = ""
    kernels: list[KernelReport] = field(default_factory=list)
    externs: list[str] = field(default_factory=list)
    fallback: str | None = None
    compile_seconds: float = 0.0
    num_nodes: int = 0
    fusion: list[FusionReport] = field(default_factory=list)
    host_source: str = ""

    def summary(self) -> str:
        if self.fallback:
            return f"{self.kind} graph: ran eagerly ({self.fallback})"
        return (
            f"{self.kind} graph: {self.num_nodes} ATen ops -> {len(self.kernels)} {self.backend} kernels "
            f"+ {len(self.externs)} externs in {self.compile_seconds * 1000:.0f} ms"
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        for k in self.kernels:
            lines.append(f"  kernel {k}")
        for e in self.externs:
            lines.append(f"  extern {e}")
        return "\n".join(lines)


@dataclass
class ExplainReport:
    graphs: list[GraphReport] = field(default_factory=list)

    @property
    def kernels(self) -> list[KernelReport]:
        return [k for g in self.graphs for k in g.kernels]

    def __str__(self) -> str:
        if not self.graphs:
            return "ember compiled no graphs"
        return "\n".join(str(g) for g in self.graphs)


# Process-wide, not thread-local: autograd compiles the backward graph on its own thread.
_collectors: list[ExplainReport] = []
_lock = threading.Lock()


@contextlib.contextmanager
def collecting() -> Iterator[ExplainReport]:
    """Collect the GraphReports of every graph compiled while the block runs."""
    report = ExplainReport()
    with _lock:
        _collectors.append(report)
    try:
        yield report
    finally:
        with _lock:
            _collectors.remove(report)


def publish(graph_report: GraphReport) -> None:
    with _lock:
        for report in _collectors:
            report.graphs.append(graph_report)
