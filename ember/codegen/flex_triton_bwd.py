"""FlexAttention's backward as Triton kernels (ir/flex.py: FlexBackwardSpec), FlashAttention-2's:

- `flex_bwd_dq`: a program holds BLOCK_M query rows and walks the key blocks the BlockMask lists for
  them (as the forward does); per step it recomputes the scores, p = exp2(s * log2e - lse), then
  dp = dO v^T, ds = p (dp - delta) and the gradient before score_mod (the joint graph's program,
  inlined), and accumulates dq += ds k.
- `flex_bwd_dkdv`: a program holds BLOCK_N keys of one key/value head and, for each query head of
  its group (GQA), walks the query blocks the BlockMask's transpose (q_num_blocks, q_indices) lists
  for its key block: dv += p^T dO, dk += ds^T q, with the scores computed transposed (k q^T).
delta = rowsum(dO * out) is computed before, by `flex_bwd_delta` (one read of both, in the work dtype). Masked elements (mask_mod, outside the listed
blocks, past the sequence) have p = 0 and a zero gradient.

With the constant ATOMIC_DQ, `flex_bwd_dkdv` computes dq as well, FlashAttention-3's way: each of its steps
adds ds^T's transpose times k into a zeroed accumulator in the work dtype, in GQ's place, with atomic adds
(five products per step instead of seven: the scores and dp are computed once), and
`flex_bwd_dq_convert` scales and casts the accumulator into dq; `flex_bwd_delta` zeroes it with
ZERO_DQ. The adds come in any order, so dq is not bitwise reproducible from run to run
(backends/flex.py: `atomic_dq` says where this way is taken).

Parameters: Q, K, V, DO, LSE, DELTA, GQ, GK, GV (dq, dk, dv), the BlockMask's kv and q tensors (full ones where
listed apart), each captured tensor, then the integers of `PARAMS`, then each captured tensor's
sizes and strides.
"""

from __future__ import annotations

from ember.codegen.flex_expr import TRITON_TYPES, render_program
from ember.codegen.flex_triton import QUERY_TILE, block_walk, bounded_loads, drop_full_masks, scale_log2, truth
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

    def kept(masked: bool, p_value: str, bound: str, even: str, shape: str, body: list[str]) -> list[str]:
        """`p` (`p_value` where kept) and the gradient `gs` of one step, zero where the mask drops a score
        (a masked step with a mask_mod) or where `bound` does (the other operand's rows past the
        sequence, unless the constant `even` says there are none): a full block inside the sequence
        selects nothing. `body` computes ds from p. The program's own rows past the sequence are not
        bounded: they are never stored, and each row's result reads only that row (the atomic dq, a sum over
        the dk/dv program's own keys, bounds them itself: EVEN_KEYS)."""
        if masked and mask_result is not None:
            keep = [
                *mask_lines,
                f"keep = tl.broadcast_to({truth(fwd.mask, mask_result)}, [{shape}])",
                f"if not {even}:",
                f"    keep = keep & {bound}",
            ]
            return [
                *keep,
                f"p = tl.where(keep, {p_value}, 0.0)",
                *body,
                *grad_lines,
                f"gs = tl.where(keep, ({grad_result}).to({wt}), 0.0)",
            ]
        return [
            f"p = {p_value}",
            f"if not {even}:",
            f"    p = tl.where({bound}, p, 0.0)",
            *body,
            *grad_lines,
            f"gs = ({grad_result}).to({wt})",
            f"if not {even}:",
            f"    gs = tl.where({bound}, gs, 0.0)",
        ]

    def scores(a: str, bt: str, shape: str) -> list[str]:
        """`val2`: the scores after score_mod, in base 2 (the scale and log2(e) in one multiply where
        there is no score_mod; broadcast_to, not `+ zeros`, which costs an add per score)."""
        if fwd.score is None:
            return [f"val2 = tl.dot({a}, {bt}{precision}).to({wt}) * {scale_log2(fwd.scale)}"]
        return [
            f"sc = tl.dot({a}, {bt}{precision}).to({wt}) * {fwd.scale!r}",
            *score_lines,
            f"val2 = tl.broadcast_to(({score_result}).to({wt}) * 1.4426950408889634, [{shape}])",
        ]

    def dq_tile(masked: bool) -> list[str]:
        """One dq step over [BLOCK_M queries, BLOCK_N keys]; the caller holds q, do, lse, delta, k, v,
        q_idx, kv_idx and kmask."""
        lines = [
            *scores("q", "tl.trans(k)", "BLOCK_M, BLOCK_N"),
            *kept(
                masked,
                "tl.exp2(val2 - lse[:, None])",
                "kmask[None, :]",
                "EVEN_N",
                "BLOCK_M, BLOCK_N",
                [f"dp = tl.dot(do, tl.trans(v){precision}).to({wt})", "ds = p * (dp - delta[:, None])"],
            ),
            f"dq += tl.dot(gs.to(k.dtype), k{precision})",
        ]
        return lines

    def dkdv_tile(masked: bool) -> list[str]:
        """One dk/dv step, computed transposed, over [BLOCK_N keys, BLOCK_M queries]: the scores as
        k q^T, so that p^T and ds^T come out of their products in the layout the next products take as
        their left operand, with no transpose through shared memory (q_idx runs along columns and
        kv_idx along rows here; the score, mask and gradient programs are elementwise)."""
        lines = [
            *scores("k", "tl.trans(q)", "BLOCK_N, BLOCK_M"),
            *kept(
                masked,
                "tl.exp2(val2 - lse[None, :])",
                "qmask[None, :]",
                "EVEN_M",
                "BLOCK_N, BLOCK_M",
                [f"dp = tl.dot(v, tl.trans(do){precision}).to({wt})", "ds = p * (dp - delta[None, :])"],
            ),
            f"dv += tl.dot(p.to(do.dtype), do{precision})",
            f"dk += tl.dot(gs.to(q.dtype), q{precision})",
            "if ATOMIC_DQ:",
            "    if not EVEN_KEYS:  # dq sums over the keys: the program's own keys past the sequence add nothing",
            "        gs = tl.where(kmask[:, None], gs, 0.0)",
            f"    dqp = tl.dot(tl.trans(gs.to(k.dtype)), k{precision})",
            "    tl.atomic_add(GQ + b * sab + h * sah + offs_m[:, None] * sam + offs_d[None, :] * sad, dqp,",
            '                  mask=qmask[:, None] & (offs_d[None, :] < D), sem="relaxed")',
        ]
        return lines

    def kv_walk(num: str, idx: str, cs: str, ix: str, masked: bool) -> str:
        body = [
            "offs_n = n0 + tl.arange(0, BLOCK_N)",
            "kv_idx = offs_n[None, :]",
            "kmask = offs_n < N",
            *bounded_loads(
                fwd,
                "EVEN_N",
                [
                    (
                        "k",
                        "K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd",
                        "kmask[:, None]",
                        "d",
                    ),
                    (
                        "v",
                        "V + b * svb + hk * svh + offs_n[:, None] * svn + offs_v[None, :] * svd",
                        "kmask[:, None]",
                        "v",
                    ),
                ],
            ),
            *dq_tile(masked),
        ]
        count = f"tl.load({num} + sb * {cs}b + sh * {cs}h + qb * {cs}q)"
        index = f"{idx} + sb * {ix}b + sh * {ix}h + qb * {ix}q"
        return block_walk(count, index, f"{ix}k", "kv_steps", "KV_NESTED", "KB", "BLOCK_N", "n0", body, 4)

    def q_walk(num: str, idx: str, cs: str, ix: str, masked: bool) -> str:
        body = [
            "offs_m = m0 + tl.arange(0, BLOCK_M)",
            "q_idx = offs_m[None, :]",
            "qmask = offs_m < M",
            "row = (b * H + h).to(tl.int64) * M + offs_m",
            *bounded_loads(
                fwd,
                "EVEN_M",
                [
                    (
                        "q",
                        "Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd",
                        "qmask[:, None]",
                        "d",
                    ),
                    (
                        "do",
                        "DO + b * sob + h * soh + offs_m[:, None] * som + offs_v[None, :] * sod",
                        "qmask[:, None]",
                        "v",
                    ),
                    ("lse", "LSE + row", "qmask", ""),
                    ("delta", "DELTA + row", "qmask", ""),
                ],
            ),
            'lse = tl.where(lse == -float("inf"), 0.0, lse)',
            *dkdv_tile(masked),
        ]
        count = f"tl.load({num} + sb * {cs}b + sh * {cs}h + kvb * {cs}k)"
        index = f"{idx} + sb * {ix}b + sh * {ix}h + kvb * {ix}k"
        return block_walk(count, index, f"{ix}q", "q_steps", "Q_NESTED", "QB", "BLOCK_M", "m0", body, 8)

    # Each kernel takes the constants it reads (another value of one it does not would compile it again).
    constexprs = (
        "QB: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, "
        "DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr"
    )
    dq_constexprs = f"kv_steps, {constexprs}, EVEN_N: tl.constexpr, KV_NESTED: tl.constexpr"
    dkdv_constexprs = (
        f"q_steps, {constexprs}, EVEN_M: tl.constexpr, Q_NESTED: tl.constexpr, ATOMIC_DQ: tl.constexpr, "
        "EVEN_KEYS: tl.constexpr"
    )
    dq_full = kv_walk("FULL_NUM", "FULL_IDX", "sf", "sj", False) if full else ""
    kv_full = q_walk("FULL_Q_NUM", "FULL_Q_IDX", "sz", "sw", False) if full else ""
    source = f"""
@triton.jit
def flex_bwd_rows(ROWS, H, M, BLOCK_R: tl.constexpr):
    # The program's BLOCK_R rows of a [B, H, M] walk: their flat index, bound, batch, head and position.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows, rows < ROWS, rows // (H * M), (rows // M) % H, rows % M


@triton.jit
def flex_bwd_delta(O, DO, DELTA, DQA, ROWS, H, M, sob, soh, som, sod, sdb, sdh, sdm, sdd, DV: tl.constexpr,
        DV_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, ZERO_DQ: tl.constexpr):
    rows, rmask, b, h, m = flex_bwd_rows(ROWS, H, M, BLOCK_R)
    offs_v = tl.arange(0, DV_PAD)
    inside = rmask[:, None] & (offs_v[None, :] < DV)
    o = tl.load(O + (b * sob + h * soh + m * som)[:, None] + offs_v[None, :] * sod, mask=inside, other=0.0)
    do = tl.load(DO + (b * sdb + h * sdh + m * sdm)[:, None] + offs_v[None, :] * sdd, mask=inside, other=0.0)
    tl.store(DELTA + rows, tl.sum(o.to({wt}) * do.to({wt}), 1), mask=rmask)
    if ZERO_DQ:  # the accumulator of the atomic dq, [B, H, M, D] contiguous
        offs_d = tl.arange(0, D_PAD)
        tl.store(DQA + rows[:, None] * D + offs_d[None, :], tl.zeros([BLOCK_R, D_PAD], DQA.dtype.element_ty),
                 mask=rmask[:, None] & (offs_d[None, :] < D))


@triton.jit
def flex_bwd_dq_convert(DQA, GQ, ROWS, H, M, sab, sah, sam, sad, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_R: tl.constexpr):
    rows, rmask, b, h, m = flex_bwd_rows(ROWS, H, M, BLOCK_R)
    offs_d = tl.arange(0, D_PAD)
    inside = rmask[:, None] & (offs_d[None, :] < D)
    dq = tl.load(DQA + rows[:, None] * D + offs_d[None, :], mask=inside, other=0.0)
    tl.store(GQ + (b * sab + h * sah + m * sam)[:, None] + offs_d[None, :] * sad,
             (dq * {fwd.scale!r}).to(GQ.dtype.element_ty), mask=inside)


@triton.jit
def flex_bwd_dq({params}, {dq_constexprs}):
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
    dq = dq * {fwd.scale!r}
    tl.store(GQ + b * sab + h * sah + q_idx * sam + offs_d[None, :] * sad, dq.to(GQ.dtype.element_ty),
             mask=qmask[:, None] & (offs_d[None, :] < D))


@triton.jit
def flex_bwd_dkdv({params}, {dkdv_constexprs}):
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    HK = H // G
    b = bh // HK
    hk = bh % HK
    sb = b % SB
    n0 = tile * BLOCK_N
    kvb = n0 // KB
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kv_idx = offs_n[:, None]
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
    dk = dk * {fwd.scale!r}
    tl.store(GK + b * scb + hk * sch + offs_n[:, None] * scn + offs_d[None, :] * scd, dk.to(GK.dtype.element_ty),
             mask=kmask[:, None] & (offs_d[None, :] < D))
    tl.store(GV + b * seb + hk * seh + offs_n[:, None] * sen + offs_v[None, :] * sed, dv.to(GV.dtype.element_ty),
             mask=kmask[:, None] & (offs_v[None, :] < DV))
"""
    return drop_full_masks(source, spec.forward)


__all__ = ["PARAMS", "render_flex_triton_bwd"]
