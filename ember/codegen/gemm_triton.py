"""Render a GEMM template kernel (schedule/gemm.py) as Triton source.

The template is the classic tiled product: each program owns a BLOCK_M x BLOCK_N tile of the
output (programs ordered in GROUP_M-row bands so neighbouring programs share A rows and B
columns in L2), walks K in BLOCK_K steps with `tl.dot` into an fp32 accumulator, and then
runs the epilogue: the kernel's expression DAG, with the accumulator as its `KAcc` leaf,
rendered by the same `TritonRenderer` node printers as every pointwise kernel (loads of
biases and residuals, ops, casts, stores). Operands are addressed through their strides, so a
transposed A or B (a permuted view) is read where it lies. bmm adds a batch index from the
second grid axis.

Rows and columns past the edge are clamped (`% M`) for the operand loads and masked at the
epilogue's loads and stores; K is masked only when BLOCK_K does not divide it.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from ember.codegen.render import Param, print_host_index
from ember.codegen.triton import TritonRenderer
from ember.codegen.triton_launch import LaunchConfig
from ember.ir.sizes import Expr, product
from ember.schedule.gemm import GemmKernel, TileConfig
from ember.schedule.kernel import KLoad, KStore
from ember.target import Target

GEMM_ARGS = ("gemm_m", "gemm_n", "gemm_k", "sa_z", "sa_m", "sa_k", "sb_z", "sb_k", "sb_n")


def _divides(block: int, size: Expr) -> bool:
    size = sympy.sympify(size)
    return bool(size.is_Integer) and int(size) % block == 0


class GemmRenderer(TritonRenderer):
    def __init__(self, kernel: GemmKernel, config: TileConfig, interpreted: bool):
        super().__init__(kernel, LaunchConfig(0, 0, config.num_warps, False), interpreted)
        self.gemm = kernel.gemm
        self.config = config
        self.names[id(kernel.acc)] = "acc"
        g = self.gemm
        big = max(product(g.a.shape), product(g.b.shape))
        self.wide_index = self.wide_index or not sympy.sympify(big).is_Integer or int(big) >= 2**31 - 1

    # The epilogue's tile is [BLOCK_M, BLOCK_N]; every value of it varies over rows and columns.
    def mask(self, full: bool) -> str:
        return "xmask"

    def shape(self, full: bool) -> str:
        return "[BLOCK_M, BLOCK_N]"

    def define(self, name: str, node) -> None:
        """A load masks only the edges its index walks: a bias indexed by the column alone is one
        [1, BLOCK_N] row of loads, not BLOCK_M copies of it."""
        if not isinstance(node, KLoad) or not self._varies(node.index):
            super().define(name, node)
            return
        used = self.kernel.index(node.index).free_symbols
        dvars = self.kernel.domain.vars()
        edges = [f"({v.name} < gemm_{d})" for v, d in ((dvars[-2], "m"), (dvars[-1], "n")) if v in used]
        ptr = f"{self.buffer_name(node.buffer)} + {self.index_of(node.index)}"
        mask = f", {' & '.join(edges)}, other=0" if edges else ""
        self.emit(f"{name} = tl.load({ptr}{mask})")

    def emit_store(self, store: KStore) -> None:
        if store.row is not None:  # merge.py keeps indexed stores out of GEMM templates
            raise NotImplementedError("a GEMM template renders no indexed stores")
        ptr = self.buffer_name(store.buffer)
        offset = self.index_of(store.index)
        if not self._varies(store.index):
            offset += " + tl.zeros([BLOCK_M, BLOCK_N], tl.int32)"  # a block of pointers, so the mask applies
        self.emit(f"tl.store({ptr} + {offset}, {self._tensor(store.value, False)}, xmask)")

    def _dot(self) -> str:
        dtype = self.gemm.out.dtype
        if self.interpreted:
            # The interpreter's dot mishandles bf16; bf16/fp16 products are exact in fp32.
            return "tl.dot(a.to(tl.float32), b.to(tl.float32))"
        if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
            return 'tl.dot(a, b, input_precision="ieee")'  # eager's fp32 matmul does not round to tf32
        return "tl.dot(a, b)"

    def render(self) -> str:
        k, g, cfg = self.kernel, self.gemm, self.config
        a, b = self.buffer_name(g.a), self.buffer_name(g.b)
        args = [p.name for p in self.params] + list(GEMM_ARGS)
        args += [f"{c}: tl.constexpr" for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")]
        self.emit("@triton.jit")
        self.emit(f"def {k.name}({', '.join(args)}):")
        self.indent += 1
        emit = self.emit
        emit("pid = tl.program_id(0)")
        emit("grid_m = tl.cdiv(gemm_m, BLOCK_M)")
        emit("grid_n = tl.cdiv(gemm_n, BLOCK_N)")
        emit("band = GROUP_M * grid_n")
        emit("first_m = (pid // band) * GROUP_M")
        emit("band_m = tl.minimum(grid_m - first_m, GROUP_M)")
        emit("pid_m = first_m + (pid % band) % band_m")
        emit("pid_n = (pid % band) // band_m")
        cast = ".to(tl.int64)" if self.wide_index else ""
        emit(f"offs_m = pid_m{cast} * BLOCK_M + tl.arange(0, BLOCK_M)")
        emit(f"offs_n = pid_n{cast} * BLOCK_N + tl.arange(0, BLOCK_N)")
        # Contiguity hints only where no tile wraps around the edge.
        rm, rn = "offs_m % gemm_m", "offs_n % gemm_n"
        if _divides(cfg.block_m, g.m):
            rm = f"tl.max_contiguous(tl.multiple_of({rm}, BLOCK_M), BLOCK_M)"
        if _divides(cfg.block_n, g.n):
            rn = f"tl.max_contiguous(tl.multiple_of({rn}, BLOCK_N), BLOCK_N)"
        emit(f"rm = {rm}")
        emit(f"rn = {rn}")
        emit(f"rk = tl.arange(0, BLOCK_K){cast}")
        batch = ""
        if g.batched:
            emit(f"dz = tl.program_id(1){cast}")
            batch = "dz * sa_z + "
        emit(f"a_ptrs = {a} + {batch}rm[:, None] * sa_m + rk[None, :] * sa_k")
        emit(f"b_ptrs = {b} + {batch.replace('sa_z', 'sb_z')}rk[:, None] * sb_k + rn[None, :] * sb_n")
        emit("acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
        emit("for kk in range(0, tl.cdiv(gemm_k, BLOCK_K)):")
        self.indent += 1
        if _divides(cfg.block_k, g.k):
            emit("a = tl.load(a_ptrs)")
            emit("b = tl.load(b_ptrs)")
        else:
            emit("k_left = gemm_k - kk * BLOCK_K")
            emit("a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)")
            emit("b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)")
        emit(f"acc += {self._dot()}")
        emit("a_ptrs += BLOCK_K * sa_k")
        emit("b_ptrs += BLOCK_K * sb_k")
        self.indent -= 1
        # The epilogue: domain vars are (batch,) rows, columns of the output tile.
        dvars = [v.name for v in k.domain.vars()]
        if g.batched:
            emit(f"{dvars[0]} = dz")
        emit(f"{dvars[-2]} = offs_m[:, None]")
        emit(f"{dvars[-1]} = offs_n[None, :]")
        emit(f"xmask = ({dvars[-2]} < gemm_m) & ({dvars[-1]} < gemm_n)")
        self.body()
        emit("return")
        return "\n".join(self.lines)


@dataclass
class GemmKernelSource:
    """A rendered template kernel and how the host program launches it."""

    kernel: GemmKernel
    source: str
    params: list[Param]
    config: TileConfig

    def sizes(self) -> list[Expr]:
        """The template's integer arguments, in GEMM_ARGS order."""
        g = self.kernel.gemm
        return [g.m, g.n, g.k, *g.a_strides, *g.b_strides]

    def constants(self) -> dict[str, int]:
        c = self.config
        return {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "GROUP_M": c.group_m}

    def grid(self) -> tuple[str, str]:
        g, c = self.kernel.gemm, self.config
        m, n = print_host_index(g.m), print_host_index(g.n)
        return f"triton.cdiv({m}, {c.block_m}) * triton.cdiv({n}, {c.block_n})", print_host_index(g.batch)

    def launch_line(self, buffers: list[str]) -> str:
        bufs = iter(buffers)
        parts = [next(bufs) if p.kind == "buffer" else print_host_index(p.value) for p in self.params]
        parts += [print_host_index(sympy.sympify(e)) for e in self.sizes()]
        parts += [f"{name}={value}" for name, value in self.constants().items()]
        c = self.config
        x, z = self.grid()
        return f"{self.kernel.name}[({x}, {z})]({', '.join(parts)}, num_warps={c.num_warps}, num_stages={c.num_stages})"

    def warmup_args(self) -> tuple[list, dict] | None:
        """Argument types for Triton's `warmup` (compile without launching); None when a size is symbolic."""
        sizes = [p.value for p in self.params if p.kind == "size"] + self.sizes()
        if any(not sympy.sympify(s).is_Integer for s in sizes):
            return None
        args = [p.value.dtype for p in self.params if p.kind == "buffer"] + [int(sympy.sympify(s)) for s in sizes]
        c = self.config
        return args, {**self.constants(), "num_warps": c.num_warps, "num_stages": c.num_stages}


def render_gemm(kernel: GemmKernel, target: Target, config: TileConfig | None = None) -> GemmKernelSource:
    """The template kernel's source for `target`, with the tile `config` (default: the one chosen)."""
    config = config or kernel.gemm.config
    r = GemmRenderer(kernel, config, target.interpreted)
    source = r.render()
    return GemmKernelSource(kernel, source, r.params, config)
