"""Render a GEMM template kernel (schedule/gemm.py) as C++: float32 products of static sizes on the CPU.

The product is cut into panels of 16 output columns. Each work item is one panel over a band of rows (all
rows, unless there are fewer panels than threads): its thread copies the panel's K x 16 slice of B into a
buffer of its own, in the order the inner loop reads it (16 floats a step of K, one cache line), then
walks the band's rows six at a time.
Six rows by 16 columns is the register tile: 12 accumulators of 8 floats, each step of K two
loads of B, six broadcasts of A and 12 fused multiply-adds (AVX2's 16 vector registers; GCC's
vector extensions, so any target compiles it). The tile's values go to a small array, and the
epilogue, the kernel's expression DAG with the accumulator as its `KAcc` leaf, runs over the tile's
valid elements as a vector loop along the columns, rendered by the same `CppRenderer` node
printers as every pointwise kernel (a bias by column, an activation, a residual add, a cast).

B is copied on every call, so it may lie in any layout (a linear layer's weight read transposed);
the copy costs one pass over B, which the product reads anyway. A is read where it lies: the
template is chosen only for an A whose K is contiguous (backends/cpp.py).

How the work is cut is decided at run time from the thread count: panels go to threads first (each
panel copied once); rows are cut only where there are fewer panels than threads.
"""

from __future__ import annotations

import sympy

from ember.codegen.cpp import CppRenderer
from ember.schedule.gemm import GemmKernel
from ember.schedule.kernel import KStore
from ember.target import Target

TILE_ROWS = 6  # GEMM_PRELUDE's `ember_gemm_rows` takes 1 to 6 rows
TILE_COLUMNS = 16
# A thread's panel of B lives on its stack up to this size (K up to 1024), else on the heap, allocated
# once a call: a larger array could overflow an OpenMP worker's stack.
STACK_PANEL_BYTES = 64 * 1024

# Helpers shared by every template kernel of a translation unit.
GEMM_PRELUDE = r"""
#include <cstdlib>
#include <omp.h>
typedef float ember_v8 __attribute__((vector_size(32)));
// MR rows of A times a copied 16-column panel of B over K: the accumulators stay in registers and
// are written to c (MR x 16).
template <int MR>
static inline void ember_gemm_tile(const float* __restrict__ a, int64_t sa_m, int64_t sa_k,
                                   const float* __restrict__ panel, int64_t K, float* __restrict__ c) {
    ember_v8 acc0[MR], acc1[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        acc0[r] = ember_v8{};
        acc1[r] = ember_v8{};
    }
    for (int64_t k = 0; k < K; k++) {
        const ember_v8 b0 = *reinterpret_cast<const ember_v8*>(panel + 16 * k);
        const ember_v8 b1 = *reinterpret_cast<const ember_v8*>(panel + 16 * k + 8);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const float x = a[r * sa_m + k * sa_k];
            acc0[r] += x * b0;
            acc1[r] += x * b1;
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        std::memcpy(c + 16 * r, &acc0[r], sizeof(ember_v8));
        std::memcpy(c + 16 * r + 8, &acc1[r], sizeof(ember_v8));
    }
}
static inline void ember_gemm_rows(int rows, const float* a, int64_t sa_m, int64_t sa_k, const float* panel,
                                   int64_t K, float* c) {
    switch (rows) {
        case 6: ember_gemm_tile<6>(a, sa_m, sa_k, panel, K, c); break;
        case 5: ember_gemm_tile<5>(a, sa_m, sa_k, panel, K, c); break;
        case 4: ember_gemm_tile<4>(a, sa_m, sa_k, panel, K, c); break;
        case 3: ember_gemm_tile<3>(a, sa_m, sa_k, panel, K, c); break;
        case 2: ember_gemm_tile<2>(a, sa_m, sa_k, panel, K, c); break;
        default: ember_gemm_tile<1>(a, sa_m, sa_k, panel, K, c); break;
    }
}
"""


def _int(e) -> int:
    e = sympy.sympify(e)
    if not e.is_Integer:
        raise NotImplementedError(f"the C++ GEMM template takes static sizes, not {e}")
    return int(e)


class CppGemmRenderer(CppRenderer):
    def __init__(self, kernel: GemmKernel, target: Target, shared: frozenset = frozenset()):
        super().__init__(kernel, shared, target.heuristics.cpp)
        self.gemm = kernel.gemm
        self.names[id(kernel.acc)] = "acc"

    def emit_store(self, store: KStore) -> None:
        if store.row is not None:  # merge.py keeps indexed stores out of GEMM templates
            raise NotImplementedError("a GEMM template renders no indexed stores")
        super().emit_store(store)

    def render(self) -> str:
        k, g = self.kernel, self.gemm
        if g.batched:
            raise NotImplementedError("the C++ GEMM template renders 2-d products (bmm stays ATen's)")
        m, n, kk = _int(g.m), _int(g.n), _int(g.k)
        _, sa_m, sa_k = (_int(s) for s in g.a_strides)
        _, sb_k, sb_n = (_int(s) for s in g.b_strides)
        a, b = self.buffer_name(g.a), self.buffer_name(g.b)
        emit = self.emit
        emit(self.signature("void"))
        self.indent += 1
        emit(f"constexpr int64_t M = {m}, N = {n}, K = {kk};")
        emit(f"constexpr int64_t PANELS = (N + {TILE_COLUMNS - 1}) / {TILE_COLUMNS};")
        emit(f"constexpr int64_t ROW_TILES = (M + {TILE_ROWS - 1}) / {TILE_ROWS};")
        emit("// Panels to threads first; rows cut into as many bands as it takes to give each thread work.")
        emit(f"const int64_t threads = M * N * K <= {self.h.parallel_threshold} ? 1 : omp_get_max_threads();")
        emit("const int64_t row_bands = PANELS >= threads ? 1 : std::min(ROW_TILES, (threads + PANELS - 1) / PANELS);")
        emit(f"const int64_t band_rows = (ROW_TILES + row_bands - 1) / row_bands * {TILE_ROWS};")
        emit("#pragma omp parallel num_threads(threads) if(threads > 1)")
        emit("{")
        self.indent += 1
        on_stack = kk * TILE_COLUMNS * 4 <= STACK_PANEL_BYTES
        if on_stack:
            emit(f"alignas(64) float panel[K * {TILE_COLUMNS}];")
        else:
            emit(f"float* panel = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * K * {TILE_COLUMNS}));")
            emit("if (panel == nullptr) std::abort();  // no memory for 256 KB at most: stop rather than compute wrong")
        emit(f"alignas(64) float tile[{TILE_ROWS} * {TILE_COLUMNS}];")
        emit("#pragma omp for schedule(static)")
        emit("for (int64_t item = 0; item < PANELS * row_bands; item++) {")
        self.indent += 1
        emit("const int64_t p = item % PANELS, band = item / PANELS;")
        emit(f"const int64_t n0 = p * {TILE_COLUMNS}, cols = std::min<int64_t>({TILE_COLUMNS}, N - n0);")
        # The copy walks B along its contiguous dimension.
        if sb_k == 1 and sb_n != 1:
            emit(f"for (int64_t j = 0; j < {TILE_COLUMNS}; j++)")
            emit("    for (int64_t q = 0; q < K; q++)")
            emit(f"        panel[q * {TILE_COLUMNS} + j] = j < cols ? {b}[q * {sb_k} + (n0 + j) * {sb_n}] : 0.0f;")
        else:
            emit("for (int64_t q = 0; q < K; q++)")
            emit(f"    for (int64_t j = 0; j < {TILE_COLUMNS}; j++)")
            emit(f"        panel[q * {TILE_COLUMNS} + j] = j < cols ? {b}[q * {sb_k} + (n0 + j) * {sb_n}] : 0.0f;")
        emit("const int64_t row_end = std::min<int64_t>(M, (band + 1) * band_rows);")
        emit(f"for (int64_t m0 = band * band_rows; m0 < row_end; m0 += {TILE_ROWS}) {{")
        self.indent += 1
        emit(f"const int rows = static_cast<int>(std::min<int64_t>({TILE_ROWS}, row_end - m0));")
        emit(f"ember_gemm_rows(rows, {a} + m0 * {sa_m}, {sa_m}, {sa_k}, panel, K, tile);")
        dvars = [v.name for v in k.domain.vars()]
        emit("for (int r = 0; r < rows; r++) {")
        self.indent += 1
        emit(f"const int64_t {dvars[-2]} = m0 + r;")
        emit("#pragma omp simd")
        emit("for (int64_t c = 0; c < cols; c++) {")
        self.indent += 1
        emit(f"const int64_t {dvars[-1]} = n0 + c;")
        emit(f"const float acc = tile[r * {TILE_COLUMNS} + c];")
        self.body()
        for _ in range(4):
            self.indent -= 1
            emit("}")
        if not on_stack:
            emit("std::free(panel);")
        self.indent -= 1
        emit("}")
        self.indent -= 1
        emit("}")
        return "\n".join(self.lines)


def render_cpp_gemm(kernel: GemmKernel, target: Target, shared: frozenset = frozenset()) -> tuple[str, list]:
    r = CppGemmRenderer(kernel, target, shared)
    return r.render(), r.params
