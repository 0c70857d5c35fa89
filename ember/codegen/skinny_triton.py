"""Render a group of skinny products (schedule/skinny.py: SkinnySpec) as one Triton kernel.

Each program computes BLOCK_N columns of one product over the whole depth: a [16, BLOCK_K] tile of the
input (rows past M masked to zero: tl.dot takes at least 16) times a [BLOCK_K, BLOCK_N] tile of the
product's matrix, accumulated in fp32, plus the bias, rounded once to the product's dtype as cuBLAS
rounds its result. The launch's programs are the products' column blocks one after another; a program
compares its id with each product's first block, as a combo kernel's do (codegen/triton_combo.py).

Sizes are the spec's, written into the source (at most MAX_ROWS rows: one row block); strides are arguments, so a transposed weight
(K contiguous) and a row-major one are both read where they lie (Triton specializes a stride of 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.codegen.triton_combo import block_starts, part_dispatch
from ember.ir.sizes import pow2_ceil
from ember.schedule.skinny import MAX_ROWS, SkinnySpec

KERNEL = "skinny_products"
BLOCK_M = MAX_ROWS


@dataclass(frozen=True)
class SkinnyLaunch:
    block_n: int
    block_k: int
    warps: int
    stages: int


def tile(spec: SkinnySpec, launch: SkinnyLaunch) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for the spec: the launch's, no larger than the products need."""
    block_n = min(launch.block_n, max(16, pow2_ceil(max(spec.columns))))
    block_k = min(launch.block_k, max(16, pow2_ceil(spec.depth)))
    return block_n, block_k


def first_blocks(spec: SkinnySpec, block_n: int) -> tuple[list[int], int]:
    """Each product's first program, and the launch's programs."""
    return block_starts(list(spec.columns), block_n)


def _dot(interpreted: bool) -> str:
    if interpreted:
        # The interpreter's dot mishandles bf16; bf16/fp16 products are exact in fp32.
        return "tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc)"
    return "tl.dot(xt, wt, acc)"


def _rounded(spec: SkinnySpec, interpreted: bool) -> str:
    if interpreted and spec.dtype == torch.bfloat16:
        return "ember_round_bf16(acc)"  # the interpreter truncates fp32 -> bf16 (codegen/triton.py's prelude)
    return "acc.to(o.dtype.element_ty)"


def render_skinny(spec: SkinnySpec, launch: SkinnyLaunch, interpreted: bool) -> str:
    """The kernel's source: a tile function and the `skinny_products` kernel. Its arguments: the input,
    the matrices, the outputs and the biases (pointers), then the input's two strides, each matrix's
    two (depth, column) and each bias's column stride."""
    block_n, block_k = tile(spec, launch)
    m, k = spec.rows, spec.depth
    even_k = k % block_k == 0
    lines = [
        "@triton.jit",
        "def skinny_tile(a, w, o, bias, pid, sa_m, sa_k, sw_k, sw_n, sb_n, N: tl.constexpr, HAS_BIAS: tl.constexpr):",
        # Offsets in 64 bits: they follow the run-time strides, and a matrix that is a slice of a wider one
        # (a few columns of a fused weight) reaches past 2**31 elements where its own n * k does not.
        f"    rm = tl.arange(0, {BLOCK_M}).to(tl.int64)",
        f"    rn = pid.to(tl.int64) * {block_n} + tl.arange(0, {block_n})",
        f"    rk = tl.arange(0, {block_k}).to(tl.int64)",
        "    rw = rn % N",  # columns past the edge read a valid column; their results are not stored
        "    a_ptrs = a + rm[:, None] * sa_m + rk[None, :] * sa_k",
        "    w_ptrs = w + rk[:, None] * sw_k + rw[None, :] * sw_n",
        f"    acc = tl.zeros([{BLOCK_M}, {block_n}], dtype=tl.float32)",
        f"    for kk in range({-(-k // block_k)}):",
    ]
    if even_k:
        lines += [
            f"        xt = tl.load(a_ptrs, mask=rm[:, None] < {m}, other=0.0)",
            "        wt = tl.load(w_ptrs)",
        ]
    else:
        lines += [
            f"        k_left = {k} - kk * {block_k}",
            f"        xt = tl.load(a_ptrs, mask=(rm[:, None] < {m}) & (rk[None, :] < k_left), other=0.0)",
            "        wt = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)",
        ]
    lines += [
        f"        acc = {_dot(interpreted)}",
        f"        a_ptrs += {block_k} * sa_k",
        f"        w_ptrs += {block_k} * sw_k",
        "    if HAS_BIAS:",
        "        acc += tl.load(bias + rn * sb_n, mask=rn < N, other=0.0).to(tl.float32)[None, :]",
        "    out = o + rm[:, None] * N + rn[None, :]",
        f"    tl.store(out, {_rounded(spec, interpreted)}, mask=(rm[:, None] < {m}) & (rn[None, :] < N))",
        "",
        "",
    ]
    count = len(spec.columns)
    ws = [f"w{i}" for i in range(count)]
    os_ = [f"o{i}" for i in range(count)]
    bs = [f"bias{i}" for i, has in enumerate(spec.biases) if has]
    strides = ["sa_m", "sa_k"] + [f"sw{i}_{d}" for i in range(count) for d in ("k", "n")]
    strides += [f"sb{i}_n" for i, has in enumerate(spec.biases) if has]
    lines += [
        "@triton.jit",
        f"def {KERNEL}({', '.join(['a', *ws, *os_, *bs, *strides])}):",
        "    pid = tl.program_id(0)",
    ]
    starts, _ = first_blocks(spec, block_n)
    for i, (n, has) in enumerate(zip(spec.columns, spec.biases)):
        test, block = part_dispatch(i, starts)
        bias, sb = (f"bias{i}", f"sb{i}_n") if has else (f"w{i}", "0")
        args = f"a, w{i}, o{i}, {bias}, {block}, sa_m, sa_k, sw{i}_k, sw{i}_n, {sb}, {n}, {has}"
        lines += [f"    {test}", f"        skinny_tile({args})"]
    return "\n".join(lines) + "\n"


__all__ = ["BLOCK_M", "KERNEL", "SkinnyLaunch", "first_blocks", "render_skinny", "tile"]
