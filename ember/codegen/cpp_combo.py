"""Render a combo kernel (schedule/kernel.py: ComboKernel) as C++ with OpenMP.

Each part becomes a `static inline` function over a range of its outermost loop dim (its inner
dims whole, the innermost an `omp simd` loop), the body codegen/cpp.py renders for a pointwise
kernel. The combo kernel's work items are the parts' chunks of about
`heuristics.horizontal.cpu_item_elements` elements, one after another; one OpenMP loop hands them
to the threads (dynamically: a part's last chunk is short) where some part alone would have run
in parallel (over `heuristics.cpp.parallel_threshold` elements, as codegen/cpp.py decides), else
the calling thread runs them all. A combo kernel never opens a parallel region its parts did not:
on a machine whose other cores are busy, a region waits at its barrier for a thread that
is not running, which costs more than small parts run one after another.
"""

from __future__ import annotations

from collections.abc import Callable

from ember.codegen.cpp import CPP_DTYPE, CppRenderer
from ember.codegen.render import Param, combo_params, print_index
from ember.ir.sizes import product
from ember.schedule.kernel import ComboKernel, Kernel
from ember.target import Target


class _PartRenderer(CppRenderer):
    """A pointwise kernel as a function of the rows [begin, end) of its outermost loop dim."""

    def render_part(self, name: str) -> str:
        self._acc_names = {}
        self.emit(f"static inline void {name}({', '.join(self._args() + ['int64_t begin', 'int64_t end'])}) {{")
        self.indent += 1
        outer = self._dims(reduce=False)
        if not outer:  # a 0-d kernel: one item of one element
            self.body()
        for pos, (v, s) in enumerate(outer):
            if pos == len(outer) - 1:
                self.emit("#pragma omp simd")
            low, high = ("begin", "end") if pos == 0 else ("0", print_index(s, "/"))
            self.emit(f"for (int64_t {v.name} = {low}; {v.name} < {high}; {v.name}++) {{")
            self.indent += 1
        if outer:
            self.body()
        for _ in outer:
            self.indent -= 1
            self.emit("}")
        self.indent -= 1
        self.emit("}")
        return "\n".join(self.lines)

    def _args(self) -> list[str]:
        args = []
        for p in self.params:
            const = "" if p.written else "const "
            restrict = "" if p.value in self.shared else " __restrict__"
            args.append(f"{const}{CPP_DTYPE[p.value.dtype]}*{restrict} {p.name}")
        return args

    def chunking(self, item_elements: int) -> tuple[int, int]:
        """(rows of the outermost dim per work item, the part's rows)."""
        outer = self._dims(reduce=False)
        if not outer:
            return 1, 1
        rows = int(outer[0][1])
        inner = int(product([s for _, s in outer[1:]]))
        return max(1, item_elements // max(1, inner)), rows


def render_cpp_combo(
    kernel: ComboKernel, target: Target, shared: Callable[[Kernel], frozenset]
) -> tuple[str, list[Param]]:
    """`shared(part)`: the part's buffers whose memory another of its buffers uses (memory.MemoryPlan)."""
    if any(any(p.loop_reduce) or p.reduces for p in kernel.parts):
        raise NotImplementedError("a combo kernel's parts are pointwise")
    renderers = [_PartRenderer(p, shared(p), target.heuristics.cpp) for p in kernel.parts]
    names = [f"{kernel.name}_p{n}" for n in range(len(kernel.parts))]
    sources = [r.render_part(name) for r, name in zip(renderers, names)]
    params = combo_params(kernel.reads, kernel.writes)
    chunks = [r.chunking(target.heuristics.horizontal.cpu_item_elements) for r in renderers]
    firsts = [0]
    for per_item, rows in chunks:
        firsts.append(firsts[-1] + -(-rows // per_item))
    items = firsts[-1]
    args = [f"{'' if p.written else 'const '}{CPP_DTYPE[p.value.dtype]}* {p.name}" for p in params]
    lines = [f'extern "C" void {kernel.name}({", ".join(args)}) {{']
    lines.append(f"    static const int64_t first[{len(firsts)}] = {{{', '.join(map(str, firsts))}}};")
    largest = max(int(product(p.loop_sizes)) for p in kernel.parts)
    if largest > target.heuristics.cpp.parallel_threshold and items > 1:
        lines.append("    #pragma omp parallel for schedule(dynamic, 1)")
    lines.append(f"    for (int64_t item = 0; item < {items}; item++) {{")
    lines.append(f"        const int64_t part = std::upper_bound(first, first + {len(firsts)}, item) - first - 1;")
    lines.append("        switch (part) {")
    for n, (r, name, (per_item, rows)) in enumerate(zip(renderers, names, chunks)):
        begin = f"(item - {firsts[n]}) * {per_item}"
        call = ", ".join([p.name for p in r.params] + [begin, f"std::min<int64_t>({begin} + {per_item}, {rows})"])
        lines.append(f"            case {n}: {name}({call}); break;")
    lines += ["        }", "    }", "}"]
    return "\n\n".join(sources + ["\n".join(lines)]), params
