"""FlexAttention's backward as two Triton kernels (ir/flex.py: FlexBackwardSpec), FlashAttention-2's:

- `flex_bwd_dq`: a program holds BLOCK_M query rows and walks the key blocks the BlockMask lists for
  them (as the forward does); per step it recomputes the scores, p = exp2(s * log2e - lse), then
  dp = dO v^T, ds = p (dp - delta) and the gradient before score_mod (the joint graph's program,
  inlined), and accumulates dq += ds k.
- `flex_bwd_dkdv`: a program holds BLOCK_N keys of one key/value head and, for each query head of
  its group (GQA), walks the query blocks the BlockMask's transpose (q_num_blocks, q_indices) lists
  for its key block: dv += p^T dO, dk += ds^T q.
delta = rowsum(dO * out) is computed before, by ATen. Masked elements (mask_mod, outside the listed
blocks, past the sequence) have p = 0 and a zero gradient.

Parameters: Q, K, V, DO, LSE, DELTA, GQ, GK, GV (dq, dk, dv), the BlockMask's kv and q tensors (full ones where
listed apart), each captured tensor, then the integers of `PARAMS`, then each captured tensor's
sizes and strides.
"""

from __future__ import annotations

from ember.codegen.flex_expr import TRITON_TYPES, render_program
from ember.codegen.flex_triton import QUERY_TILE, drop_full_masks
from ember.ir.flex import FlexBackwardSpec

PARAMS = [
    *("B", "H", "M", "N", "G", "SB", "SH"),
    *("sqb", "sqh", "sqm", "sqd", "skb", "skh", "skn", "skd", "svb", "svh", "svn", "svd"),
    *("sob", "soh", "som", "sod", "sab", "sah", "sam", "sad", "scb", "sch", "scn", "scd", "seb", "seh", "sen", "sed"),
    *("snb", "snh", "snq", "sib", "sih", "siq", "sik", "sfb", "sfh", "sfq", "sjb", "sjh", "sjq", "sjk"),
    *("sxb", "sxh", "sxk", "syb", "syh", "syk", "syq", "szb", "szh", "szk", "swb", "swh", "swk", "swq"),
]
# (dO's strides: so*, dq's: sa*, dk's: sc*, dv's: se*; the q-block lists: sx*/sy* partial, sz*/sw* full.)


def render_flex_triton_bwd(spec: FlexBackwardSpec, interpreted: bool) -> str:
    fwd = spec.forward
    full = fwd.has_full_blocks
    tensors = ["Q", "K", "V", "DO", "LSE", "DELTA", "GQ", "GK", "GV", "KV_NUM", "KV_IDX"]
    tensors += ["FULL_NUM", "FULL_IDX"] if full else []
    tensors += ["Q_NUM", "Q_IDX"] + (["FULL_Q_NUM", "FULL_Q_IDX"] if full else [])
    tensors += [f"BUF{i}" for i in range(len(fwd.buffers))]
    buf_ints = [f"BUF{i}_{kind}{d}" for i, b in enumerate(fwd.buffers) for kind in ("Z", "S") for d in range(b.ndim)]
    params = ", ".join(tensors + PARAMS + buf_ints)
    wt = TRITON_TYPES[fwd.work_dtype]
    precision = ', input_precision="ieee"' if fwd.dtype.itemsize == 4 else ""

    def load(number: int, indices: list[str]) -> str:
        wrapped = [f"tl.where({ix} < 0, {ix} + BUF{number}_Z{d}, {ix})" for d, ix in enumerate(indices)]
        inside = " * ".join(f"(({wx} >= 0) & ({wx} < BUF{number}_Z{d})).to(tl.int8)" for d, wx in enumerate(wrapped))
        where = " + ".join(f"({wx}) * BUF{number}_S{d}" for d, wx in enumerate(wrapped)) or "0"
        if not inside:  # a 0-dim tensor
            return f"tl.load(BUF{number})"
        return f"tl.load(BUF{number} + ({where}), mask=({inside}) != 0, other=0)"

    names = {0: "sc", 1: "b", 2: "h", 3: "q_idx", 4: "kv_idx", 5: "ds"}
    score_lines, score_result = (
        render_program(fwd.score, "triton", names, load, "s", interpreted) if fwd.score is not None else ([], "sc")
    )
    mask_lines, mask_result = (
        render_program(fwd.mask, "triton", names, load, "mk", interpreted) if fwd.mask is not None else ([], None)
    )
    grad_lines, grad_result = (
        render_program(spec.grad, "triton", names, load, "g", interpreted) if spec.grad is not None else ([], "ds")
    )

    def tile(masked: bool, ind: int, kv_side: bool) -> str:
        """One step's p, dp, ds and gradient before score_mod; the caller holds q, do, lse, delta,
        k, v, q_idx, kv_idx, kmask (and qmask on the key side)."""
        lines = [
            f"sc = tl.dot(q, tl.trans(k){precision}).to({wt}) * scale",
            *score_lines,
            f"val = ({score_result}).to({wt}) + tl.zeros([BLOCK_M, BLOCK_N], {wt})",
            "keep = kmask[None, :] & qmask[:, None]" if kv_side else "keep = kmask[None, :]",
        ]
        if masked and mask_result is not None:
            zeros = "tl.zeros([BLOCK_M, BLOCK_N], tl.int8)"
            lines += [*mask_lines, f"keep = keep & ((({mask_result}).to(tl.int8) + {zeros}) != 0)"]
        lines += [
            "p = tl.where(keep, tl.exp2(val * 1.4426950408889634 - lse[:, None]), 0.0)",
            f"dp = tl.dot(do, tl.trans(v){precision}).to({wt})",
            "ds = p * (dp - delta[:, None])",
            *grad_lines,
            f"gs = tl.where(keep, ({grad_result}).to({wt}), 0.0)",
        ]
        if kv_side:
            lines += [
                f"dv += tl.dot(tl.trans(p.to(do.dtype)), do{precision})",
                f"dk += tl.dot(tl.trans(gs.to(q.dtype)), q{precision})",
            ]
        else:
            lines += [f"dq += tl.dot(gs.to(k.dtype), k{precision})"]
        return "\n".join(" " * ind + line for line in lines)

    def kv_walk(num: str, idx: str, cs: str, ix: str, masked: bool) -> str:
        return f"""
    count = tl.load({num} + sb * {cs}b + sh * {cs}h + qb * {cs}q)
    per_block = (tl.minimum(KB, N) + BLOCK_N - 1) // BLOCK_N
    for it in range(0, count * per_block):
        blk = tl.load({idx} + sb * {ix}b + sh * {ix}h + qb * {ix}q + (it // per_block) * {ix}k).to(tl.int64)
        n0 = (blk * KB + (it % per_block) * BLOCK_N).to(tl.int32)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kv_idx = offs_n[None, :]
        kmask = offs_n < N
        k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                    mask=kmask[:, None] & (offs_d[None, :] < D), other=0.0)
        v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_v[None, :] * svd,
                    mask=kmask[:, None] & (offs_v[None, :] < DV), other=0.0)
{tile(masked, 8, False)}
"""

    def q_walk(num: str, idx: str, cs: str, ix: str, masked: bool) -> str:
        return f"""
        count = tl.load({num} + sb * {cs}b + sh * {cs}h + kvb * {cs}k)
        per_block = (tl.minimum(QB, M) + BLOCK_M - 1) // BLOCK_M
        for it in range(0, count * per_block):
            blk = tl.load({idx} + sb * {ix}b + sh * {ix}h + kvb * {ix}k + (it // per_block) * {ix}q).to(tl.int64)
            m0 = (blk * QB + (it % per_block) * BLOCK_M).to(tl.int32)
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q_idx = offs_m[:, None]
            qmask = offs_m < M
            q = tl.load(Q + b * sqb + h * sqh + q_idx * sqm + offs_d[None, :] * sqd,
                        mask=qmask[:, None] & (offs_d[None, :] < D), other=0.0)
            do = tl.load(DO + b * sob + h * soh + q_idx * som + offs_v[None, :] * sod,
                         mask=qmask[:, None] & (offs_v[None, :] < DV), other=0.0)
            row = (b * H + h).to(tl.int64) * M + offs_m
            lse = tl.load(LSE + row, mask=qmask, other=0.0)
            lse = tl.where(lse == -float("inf"), 0.0, lse)
            delta = tl.load(DELTA + row, mask=qmask, other=0.0)
{tile(masked, 12, True)}
"""

    constexprs = (
        "scale, QB: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, "
        "DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr"
    )
    dq_full = kv_walk("FULL_NUM", "FULL_IDX", "sf", "sj", False) if full else ""
    kv_full = q_walk("FULL_Q_NUM", "FULL_Q_IDX", "sz", "sw", False) if full else ""
    source = f"""
@triton.jit
def flex_bwd_dq({params}, {constexprs}):
{QUERY_TILE}    qmask = offs_m < M
    q = tl.load(Q + b * sqb + h * sqh + q_idx * sqm + offs_d[None, :] * sqd,
                mask=qmask[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + b * sob + h * soh + q_idx * som + offs_v[None, :] * sod,
                 mask=qmask[:, None] & (offs_v[None, :] < DV), other=0.0)
    row = (b * H + h).to(tl.int64) * M + offs_m
    lse = tl.load(LSE + row, mask=qmask, other=0.0)
    lse = tl.where(lse == -float("inf"), 0.0, lse)
    delta = tl.load(DELTA + row, mask=qmask, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], {wt})
{kv_walk("KV_NUM", "KV_IDX", "sn", "si", True)}{dq_full}
    dq = dq * scale
    tl.store(GQ + b * sab + h * sah + q_idx * sam + offs_d[None, :] * sad, dq.to(GQ.dtype.element_ty),
             mask=qmask[:, None] & (offs_d[None, :] < D))


@triton.jit
def flex_bwd_dkdv({params}, {constexprs}):
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    HK = H // G
    b = bh // HK
    hk = bh % HK
    sb = b % SB
    n0 = tile * BLOCK_N
    kvb = n0 // KB
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kv_idx = offs_n[None, :]
    kmask = offs_n < N
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=kmask[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_v[None, :] * svd,
                mask=kmask[:, None] & (offs_v[None, :] < DV), other=0.0)
    dk = tl.zeros([BLOCK_N, D_PAD], {wt})
    dv = tl.zeros([BLOCK_N, DV_PAD], {wt})
    for g in range(0, G):
        h = hk * G + g
        sh = h % SH
{q_walk("Q_NUM", "Q_IDX", "sx", "sy", True)}{kv_full}
    dk = dk * scale
    tl.store(GK + b * scb + hk * sch + offs_n[:, None] * scn + offs_d[None, :] * scd, dk.to(GK.dtype.element_ty),
             mask=kmask[:, None] & (offs_d[None, :] < D))
    tl.store(GV + b * seb + hk * seh + offs_n[:, None] * sen + offs_v[None, :] * sed, dv.to(GV.dtype.element_ty),
             mask=kmask[:, None] & (offs_v[None, :] < DV))
"""
    return drop_full_masks(source, spec.forward)


__all__ = ["PARAMS", "render_flex_triton_bwd"]
