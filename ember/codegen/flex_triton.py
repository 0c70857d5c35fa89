"""FlexAttention's forward as a Triton kernel (ir/flex.py says what it computes).

A program holds BLOCK_M query rows of one (batch, query head) and walks the key blocks that the
BlockMask lists for their query block: partial blocks (mask_mod applied), then full blocks (not),
BLOCK_N keys a step (BLOCK_N divides the BlockMask's key block, BLOCK_M its query block). Each step
is a flash-attention step: q @ k^T on the tensor cores, the score and mask programs inlined over the
tile, an online softmax in base 2, and p @ v accumulated in fp32. GQA reads key/value head
`h // G`. Tiles, warps and stages come from the Target (`heuristics.flex`).

Parameters: Q, K, V, O, LSE, MAX, KV_NUM, KV_IDX, [FULL_NUM, FULL_IDX], each captured tensor, then
the integers of flex_cpp.PARAMS, then each captured tensor's sizes and strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.codegen.flex_cpp import PARAMS
from ember.codegen.flex_expr import TRITON_TYPES, hoist, render_program
from ember.ir.flex import FlexSpec


@dataclass(frozen=True)
class FlexLaunch:
    block_m: int
    block_n: int
    warps: int
    stages: int


# The start of every kernel over one tile of queries (the forward, and the backward's dq): which batch,
# head, key head (GQA), captured-tensor batch and head, and query rows the program owns. The GPU starts
# programs in the order of their ids, and the last tiles of queries come first: under a causal mask they
# walk the most keys, so the longest programs start early and the short ones fill the last wave (0.4-1.1% of
# a causal forward's time on an H200).
QUERY_TILE = """    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    sb = b % SB
    sh = h % SH
    m0 = tile * BLOCK_M
    qb = m0 // QB
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q_idx = offs_m[:, None]
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
"""


# Listed blocks of at least this many tile steps are walked block by block (block_walk()).
CONTIGUOUS_STEPS = 4


def block_walk(
    count: str,
    index: str,
    stride: str,
    steps: str,
    nested: str,
    block: str,
    tile: str,
    start: str,
    body: list[str],
    ind: int,
) -> str:
    """A loop over the blocks a BlockMask lists (`count` of them, their indices at `index` + i *
    `stride`), `steps` tiles of `tile` a block, running `body` with `start` set to each tile's first
    position; `nested` (a constant: steps >= CONTIGUOUS_STEPS, the host's) picks the loop. The step
    count is an argument, not a constant: without a BlockMask it follows the sequence's length, which
    would compile the kernel again per length (Triton makes a count of 1 a constant itself). Blocks of few steps: one flat loop, so that Triton pipelines the loads
    across blocks too. Blocks of many (no BlockMask: one block over the whole sequence): a loop over
    each block's steps, whose addresses are affine in the loop's counter; in the flat loop each
    step's addresses wait on a load of the block index, which the pipeliner cannot run ahead (ALiBi
    at 4096 tokens on an H200: 0.97 ms flat)."""
    pad = " " * ind

    def lines(block_lines: list[str], body_ind: int) -> str:
        return (
            "\n".join(pad + line for line in block_lines)
            + "\n"
            + "\n".join(" " * (ind + body_ind) + line for line in body)
        )

    flat = [
        f"for it in range(0, {count} * {steps}):",
        f"    blk = tl.load({index} + (it // {steps}) * {stride}).to(tl.int64)",
        f"    {start} = (blk * {block} + (it % {steps}) * {tile}).to(tl.int32)",
    ]
    by_block = [
        f"for blk_i in range(0, {count}):",
        f"    blk = tl.load({index} + blk_i * {stride}).to(tl.int64)",
        f"    for j in range(0, {steps}):",
        f"        {start} = (blk * {block} + j * {tile}).to(tl.int32)",
    ]
    return (
        f"\n{pad}if not {nested}:\n"
        + lines(["    " + x for x in flat], 8)
        + f"\n{pad}else:\n"
        + lines(["    " + x for x in by_block], 12)
        + "\n"
    )


def pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def render_flex_triton(spec: FlexSpec, name: str, launch: FlexLaunch, interpreted: bool) -> str:
    fixed = ["Q", "K", "V", "O", "LSE", "MAX", "KV_NUM", "KV_IDX"] + (
        ["FULL_NUM", "FULL_IDX"] if spec.has_full_blocks else []
    )
    bufs = [f"BUF{i}" for i in range(len(spec.buffers))]
    buf_ints = [f"BUF{i}_{kind}{d}" for i, b in enumerate(spec.buffers) for kind in ("Z", "S") for d in range(b.ndim)]
    params = fixed + bufs + PARAMS + buf_ints
    wt = TRITON_TYPES[spec.work_dtype]
    fp64 = spec.work_dtype.itemsize == 8

    def load(number: int, indices: list[str]) -> str:
        wrapped = [f"tl.where({ix} < 0, {ix} + BUF{number}_Z{d}, {ix})" for d, ix in enumerate(indices)]
        # The bounds as a product of bytes: Triton's interpreter cannot `&` a block of booleans with a
        # scalar one (an index that depends only on the head is a scalar).
        inside = " * ".join(f"(({wx} >= 0) & ({wx} < BUF{number}_Z{d})).to(tl.int8)" for d, wx in enumerate(wrapped))
        inside = f"({inside}) != 0" if inside else ""
        where = " + ".join(f"({wx}) * BUF{number}_S{d}" for d, wx in enumerate(wrapped)) or "0"
        if not inside:  # a 0-dim tensor
            return f"tl.load(BUF{number})"
        return f"tl.load(BUF{number} + ({where}), mask={inside}, other=0)"

    args = {0: "sc", 1: "b", 2: "h", 3: "q_idx", 4: "kv_idx"}
    score_lines, score_result = (
        render_program(spec.score, "triton", args, load, "s", interpreted) if spec.score is not None else ([], "sc")
    )
    mask_lines, mask_result = (
        render_program(spec.mask, "triton", args, load, "mk", interpreted) if spec.mask is not None else ([], None)
    )
    # What depends on the batch and head alone is computed once, before the key loop.
    hoisted: list[str] = []
    for program, lines in ((spec.score, score_lines), (spec.mask, mask_lines)):
        if program is not None:
            before, lines[:] = hoist(program, lines, {1, 2})
            hoisted += before
    precision = "" if fp64 else ', input_precision="ieee"' if spec.dtype.itemsize == 4 else ""

    def dot(a: str, bt: str, acc: str | None) -> str:
        if fp64:  # Triton's dot has no fp64 path everywhere: a broadcast sum (small sizes only)
            prod = f"tl.sum({a}[:, :, None] * {bt}[None, :, :], 1)"
            return prod if acc is None else f"{acc} + {prod}"
        return f"tl.dot({a}, {bt}{', ' + acc if acc else ''}{precision})"

    k_ptr = "K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd"
    v_ptr = "V + b * svb + hk * svh + offs_n[:, None] * svn + offs_v[None, :] * svd"

    def step(full: bool) -> list[str]:
        """One BLOCK_N step. EVEN_N (the keys a multiple of BLOCK_N, decided per call): no key bound,
        so loads carry no key mask and a full block no select."""
        masked = not full and mask_result is not None
        lines = [
            "offs_n = n0 + tl.arange(0, BLOCK_N)",
            "kv_idx = offs_n[None, :]",
            "kmask = offs_n < N",
            *bounded_loads(spec, "EVEN_N", [("k", k_ptr, "kmask[:, None]", "d")]),
        ]
        # `val` is the score before the factor `base2` that takes it to base 2. Where that factor is a positive
        # normal number in the work dtype it is applied after the row maximum, which it then commutes with: one
        # multiply per row for the maximum, and per score one fused multiply-add with the subtraction of the
        # maximum, not a multiply of its own (0.5-2.3% of a causal forward's time on an H200). A factor of zero
        # (or one flushed to it) would make a masked score's -inf a NaN: such a scale keeps the multiply first.
        base2 = scale_log2(spec.scale) if spec.score is None else repr(1.4426950408889634)
        folded = spec.score is not None or positive_normal(spec.scale * 1.4426950408889634, spec.work_dtype)
        if spec.score is None:
            product = f"{dot('q', 'tl.trans(k)', None)}.to({wt})"
            lines += [f"val = {product}" if folded else f"val = {product} * {base2}"]
        else:  # (broadcast_to, not `+ zeros`: x + 0.0 is not x for x = -0.0, so it would cost an add per score)
            lines += [
                f"sc = {dot('q', 'tl.trans(k)', None)}.to({wt}) * {spec.scale!r}",
                *score_lines,
                f"val = tl.broadcast_to(({score_result}).to({wt}), [BLOCK_M, BLOCK_N])",
            ]
        if masked:
            lines += [
                *mask_lines,
                f"keep = tl.broadcast_to({truth(spec.mask, mask_result)}, [BLOCK_M, BLOCK_N])",
                "if not EVEN_N:",
                "    keep = keep & kmask[None, :]",
                'val = tl.where(keep, val, -float("inf"))',
            ]
        else:
            lines += ["if not EVEN_N:", '    val = tl.where(kmask[None, :], val, -float("inf"))']
        lines += [
            f"m_new = tl.maximum(m_i, tl.max(val, 1) * {base2})"
            if folded
            else "m_new = tl.maximum(m_i, tl.max(val, 1))",
            'm_safe = tl.where(m_new == -float("inf"), 0.0, m_new)',
            "alpha = tl.exp2(m_i - m_safe)",
            f"p = tl.exp2(val * {base2} - m_safe[:, None])" if folded else "p = tl.exp2(val - m_safe[:, None])",
            "l_i = l_i * alpha + tl.sum(p, 1)",
            *bounded_loads(spec, "EVEN_N", [("v", v_ptr, "kmask[:, None]", "v")]),
            f"acc = {dot('p.to(v.dtype)', 'v', 'acc * alpha[:, None]')}",
            "m_i = m_new",
        ]
        return lines

    def walk(num: str, idx: str, cs: str, ix: str, full: bool) -> str:
        """The loop over the key blocks a count tensor (strides `{cs}b/h/q`) and an index tensor
        (strides `{ix}b/h/q/k`) list for this program's query block, BLOCK_N keys a step."""
        count = f"tl.load({num} + sb * {cs}b + sh * {cs}h + qb * {cs}q)"
        index = f"{idx} + sb * {ix}b + sh * {ix}h + qb * {ix}q"
        return block_walk(count, index, f"{ix}k", "kv_steps", "KV_NESTED", "KB", "BLOCK_N", "n0", step(full), 4)

    part = walk("KV_NUM", "KV_IDX", "sn", "si", False)
    full = walk("FULL_NUM", "FULL_IDX", "sf", "sj", True) if spec.has_full_blocks else ""
    qload = (
        "q = tl.load(Q + b * sqb + h * sqh + q_idx * sqm + offs_d[None, :] * sqd, "
        "mask=(q_idx < M) & (offs_d[None, :] < D), other=0.0)"
    )
    store = (
        "tl.store(O + b * sob + h * soh + q_idx * som + offs_v[None, :] * sod, out.to(O.dtype.element_ty), "
        "mask=(q_idx < M) & (offs_v[None, :] < DV))"
    )
    source = f"""
@triton.jit
def {name}({", ".join(params)}, kv_steps, QB: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
        KV_NESTED: tl.constexpr):
{QUERY_TILE}    {qload}
{"".join(f"    {line}{chr(10)}" for line in hoisted)}    m_i = tl.full([BLOCK_M], -float("inf"), {wt})
    l_i = tl.zeros([BLOCK_M], {wt})
    acc = tl.zeros([BLOCK_M, DV_PAD], {wt})
{part}{full}
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
    {store}
    rmask = offs_m < M
    row = (b * H + h).to(tl.int64) * M + offs_m
    tl.store(LSE + row, tl.where(l_i == 0, -float("inf"), m_i + tl.log2(tl.where(l_i == 0, 1.0, l_i))), mask=rmask)
    tl.store(MAX + row, m_i, mask=rmask)
"""
    return drop_full_masks(source, spec)


def bounded_loads(spec: FlexSpec, even: str, loads: list[tuple[str, str, str, str]]) -> list[str]:
    """Statements loading tiles: where the constant `even` holds every row lies inside the sequence,
    so only a padded head dim bounds a load; else the row bound `rows` does too. Each load is (name,
    pointers, rows, its head dim: "d" for q and k's, "v" for v and out's, "" for a vector)."""
    padded = {"d": spec.head_dim != max(16, pow2(spec.head_dim)), "v": spec.value_dim != max(16, pow2(spec.value_dim))}
    bound = {"d": "(offs_d[None, :] < D)", "v": "(offs_v[None, :] < DV)"}
    inside, outside = [], []
    for name, ptr, rows, dim in loads:
        head = bound[dim] if dim else ""
        inside.append(
            f"    {name} = tl.load({ptr}, mask={head}, other=0.0)"
            if dim and padded[dim]
            else f"    {name} = tl.load({ptr})"
        )
        outside.append(f"    {name} = tl.load({ptr}, mask={rows}{' & ' + head if head else ''}, other=0.0)")
    return [f"if {even}:", *inside, "else:", *outside]


def truth(program, result: str) -> str:
    """A mask program's result as a boolean (a comparison's already is)."""
    return result if program.nodes[program.result].dtype == torch.bool else f"(({result}) != 0)"


def drop_full_masks(source: str, spec: FlexSpec) -> str:
    """Without padding on the head dims (a power-of-two head size), their load masks are all true:
    left out, so that loads along them stay unpredicated."""
    if spec.head_dim == max(16, pow2(spec.head_dim)):
        source = source.replace(" & (offs_d[None, :] < D)", "")
    if spec.value_dim == max(16, pow2(spec.value_dim)):
        source = source.replace(" & (offs_v[None, :] < DV)", "")
    return source


def positive_normal(x: float, dtype: torch.dtype) -> bool:
    """Whether `x`, rounded to `dtype`, is a positive normal number (the GPU may flush a subnormal to zero)."""
    return float(torch.tensor(x, dtype=dtype)) >= torch.finfo(dtype).tiny


def scale_log2(scale: float) -> str:
    """The softmax scale times log2(e), as a literal to write into the kernel's expressions: Triton
    keeps an inline literal in full double precision where it meets an fp64 value (a float argument,
    or a literal first bound to a name, is fp32: 5e-8 off for fp64 scores)."""
    return repr(scale * 1.4426950408889634)


def steps(block: int, length: int, tile: int) -> int:
    """Tile steps over one listed block of `block` positions along a sequence of `length` (a block
    larger than the sequence is walked to the sequence's end)."""
    return (min(block, length) + tile - 1) // tile


def even(block: int, length: int, tile: int) -> bool:
    """Whether every step of every listed block lies inside the sequence: loads then need no bound."""
    return length % tile == 0 and (block >= length or length % block == 0)


def block_sizes(spec: FlexSpec, launch: FlexLaunch, q_block: int, kv_block: int) -> tuple[int, int, int, int]:
    """BLOCK_M, BLOCK_N (within the BlockMask's blocks of these sizes: at most the largest power of two
    dividing each), D_PAD, DV_PAD (powers of two, 16 at least). Raises where a block would be smaller
    than Triton's dot takes."""
    block_m, block_n = min(launch.block_m, q_block & -q_block), min(launch.block_n, kv_block & -kv_block)
    if block_m < 16 or block_n < 16:
        raise RuntimeError(
            f"flex_attention: BlockMask blocks of {q_block} x {kv_block} give Triton tiles of {block_m} x {block_n}, "
            "below the 16 its dot takes"
        )
    return (
        block_m,
        block_n,
        max(16, pow2(spec.head_dim)),
        max(16, pow2(spec.value_dim)),
    )


__all__ = [
    "CONTIGUOUS_STEPS",
    "FlexLaunch",
    "block_sizes",
    "block_walk",
    "bounded_loads",
    "drop_full_masks",
    "even",
    "positive_normal",
    "pow2",
    "render_flex_triton",
    "steps",
    "truth",
]
