"""The ladder's top rung on a GPU: two hand-written Triton kernels, as a person would write them.

`matmul`: a tiled fp32 product (128x128 tiles, K in steps of 32, grouped program order for L2 reuse;
`tl.dot` with TF32 off, so it does the fp32 arithmetic the other rungs do). `layernorm_gelu`: one program
per row, the row held in registers, one read and one write of each element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _matmul_kernel(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP * grid_n)
    first_m = group * GROUP
    rows_in_group = tl.minimum(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % (GROUP * grid_n)) % rows_in_group
    pid_n = (pid % (GROUP * grid_n)) // rows_in_group
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        x = tl.load(
            a + rm[:, None] * K + (k + rk)[None, :], mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0
        )
        y = tl.load(
            b + (k + rk)[:, None] * N + rn[None, :], mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0
        )
        acc += tl.dot(x, y, input_precision="ieee")
    tl.store(c + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty(m, n, device=a.device, dtype=torch.float32)
    bm, bn, bk = 128, 128, 32
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_kernel[grid](a, b, c, m, n, k, BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=8, num_stages=3)
    return c


@triton.jit
def _layernorm_gelu_kernel(x, w, b, y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    v = tl.load(x + row * N + cols, mask=mask, other=0.0)
    mean = tl.sum(v, 0) / N
    d = tl.where(mask, v - mean, 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(d * d, 0) / N + eps)
    t = d * inv * tl.load(w + cols, mask=mask) + tl.load(b + cols, mask=mask)
    out = 0.5 * t * (1.0 + tl.erf(t * 0.7071067811865476))
    tl.store(y + row * N + cols, out, mask=mask)


def layernorm_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    rows, n = x.shape
    y = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    _layernorm_gelu_kernel[(rows,)](x, w, b, y, n, eps, BLOCK=block, num_warps=min(16, max(4, block // 256)))
    return y
