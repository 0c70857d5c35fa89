"""Records of what ember did to each graph, collected by `ember.explain` and printed by EMBER_DEBUG."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class KernelReport:
    name: str
    ops: list[str]  # the ATen ops fused into it
    domain: str
    source: str
    bytes: int | None = None  # device-memory bytes, as the cost model counts them (None if symbolic)
    flops: int | None = None
    estimate_us: float | None = None  # roofline estimate on the target (bandwidth measured)
    bound: str = ""  # "memory" | "compute": which roof the estimate sits under
    lines: list[str] = field(default_factory=list)  # the user's source lines ("file:line") its ops came from

    def __str__(self) -> str:
        cost = ""
        if self.bytes is not None:
            cost = f", {self.bytes / 1e6:.2f} MB, {self.flops / 1e6:.2f} MFLOP"
        if self.estimate_us is not None:
            cost += f", ~{self.estimate_us:.1f} us ({self.bound})"
        return f"{self.name} over {self.domain}{cost}: {' + '.join(self.ops) or '(copy)'}"


@dataclass
class FusionReport:
    consumer: str
    producer: str
    accepted: bool
    reason: str
    saved_bytes: int | None = None

    def __str__(self) -> str:
        saved = f", saves {self.saved_bytes / 1e6:.3g} MB" if self.saved_bytes else ""
        verdict = "fused" if self.accepted else "not fused"
        return f"{self.consumer} <- {self.producer}: {verdict}: {self.reason}{saved}"


@dataclass
class GraphReport:
    kind: str  # "inference" | "forward" | "backward"
    backend: str = ""
    kernels: list[KernelReport] = field(default_factory=list)
    externs: list[str] = field(default_factory=list)
    extern_lines: list[str] = field(default_factory=list)  # each extern's source line ("" where unknown)
    fallback: str | None = None
    compile_seconds: float = 0.0
    # Seconds per pipeline stage, in order (backend, import, cse, pad, split, schedule, cache write,
    # build, host; or backend, cached schedule, build, host): where compile time goes.
    stage_seconds: dict[str, float] = field(default_factory=dict)
    num_nodes: int = 0
    fusion: list[FusionReport] = field(default_factory=list)
    host_source: str = ""
    target: str = ""  # the device the estimates are for
    memory: str = ""  # the memory plan: planned peak vs eager's, buffers reused
    peak_bytes: int | None = None
    eager_peak_bytes: int | None = None
    cudagraphs: str = ""  # under CUDA graphs: "on (...)", or "off: " and why ("" when not asked for)
    # Per mutated input: the kernel or extern that writes its new value in place, or why it is copied.
    mutations: list[str] = field(default_factory=list)
    # The user's source lines of the ATen graph: "file:line" -> (its code, the ATen ops it became).
    source_lines: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    node_lines: dict[str, str] = field(default_factory=dict)  # ATen FX node name -> its source line
    aten_graph: str = ""  # the ATen graph ember compiled, as FX prints its code
    # Each kernel's code at every layer below its source (backends/layers.py), made when called.
    layers: Callable[[], dict] | None = field(default=None, repr=False, compare=False)
    # The host program's namespace: its kernels by name, which `ember explain` times one by one.
    namespace: dict | None = field(default=None, repr=False, compare=False)
    # Per functional collective: the step that starts it, the step that waits on it, what runs between.
    collectives: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int | None:
        known = [k.bytes for k in self.kernels]
        return None if None in known else sum(known)

    @property
    def rejected(self) -> list[FusionReport]:
        return [f for f in self.fusion if not f.accepted]

    def summary(self) -> str:
        if self.fallback:
            return f"{self.kind} graph: ran eagerly ({self.fallback})"
        return (
            f"{self.kind} graph: {self.num_nodes} ATen ops -> {len(self.kernels)} {self.backend} kernels "
            f"+ {len(self.externs)} externs in {self.compile_seconds * 1000:.0f} ms{self._stages()}{self._mutated()}"
        )

    def _mutated(self) -> str:
        """The mutated inputs in a line: how many are written in place, and each one copied, with why."""
        if not self.mutations:
            return ""
        copied = [m for m in self.mutations if "copied" in m]
        text = f"; {len(self.mutations)} mutated inputs, {len(self.mutations) - len(copied)} written in place"
        return text + "".join(f"; {m}" for m in copied[:4]) + ("; ..." if len(copied) > 4 else "")

    def _stages(self) -> str:
        if not self.stage_seconds:
            return ""
        return " (ms: " + ", ".join(f"{name} {s * 1000:.0f}" for name, s in self.stage_seconds.items()) + ")"

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.fallback:
            return lines[0]
        if self.target:
            lines.append(f"  target: {self.target}")
        if self.memory:
            lines.append(f"  memory: {self.memory}")
        if self.cudagraphs:
            lines.append(f"  cudagraphs: {self.cudagraphs}")
        for k in self.kernels:
            lines.append(f"  kernel {k}")
        for e in self.externs:
            lines.append(f"  extern {e}")
        for m in self.mutations:
            lines.append(f"  mutation {m}")
        for c in self.collectives:
            lines.append(f"  collective {c}")
        if self.rejected:
            lines.append(f"  fusions refused ({len(self.rejected)}):")
            lines += [f"    {f}" for f in self.rejected]
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
            # By identity: nested collectors hold equal reports (the same graphs), and list.remove would take the outer one.
            _collectors[:] = [r for r in _collectors if r is not report]


def publish(graph_report: GraphReport) -> None:
    with _lock:
        for report in _collectors:
            report.graphs.append(graph_report)
