"""FlexAttention workloads for `ember bench` (group `flex`): one attention call a step, bf16,
[B, H, S, D] query, key and value; each compiler compiles the same `flex_attention` program, and
`flex_sdpa_causal` is the same shapes through F.scaled_dot_product_attention (the fastest fused
kernel PyTorch picks on the machine), the bar for plain causal attention.

Each program runs at three sequence lengths with the same tokens a call (B·S = 16384 on the GPU):
its plain name is S 4096, `_s1k` S 1024 (B16) and `_s16k` S 16384 (B1). `gpt2_flex` (workloads.py)
is gpt2_step's model, its attention this group's causal program, beside its SDPA twin `gpt2_sdpa`.

    ember bench --workloads flex                            # every row, inference and training
    ember bench --workloads flex_causal,flex_sdpa_causal --modes inference
    ember bench --workloads flex_causal_s1k,flex_causal,flex_causal_s16k

The size is a tuple (B, H, S, D); the BlockMask, tables and document ids are built with the inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ember.tools.bench.built import Built
from ember.tools.workloads import causal

SIZES = {"gpu": (4, 16, 4096, 64), "cpu": (1, 4, 512, 64), "tiny": (1, 2, 128, 16)}
SIZES_WIDE = {"gpu": (4, 16, 4096, 128), "cpu": (1, 4, 512, 128), "tiny": (1, 2, 128, 32)}


def _qkv(size, device):
    b, h, s, d = size
    return tuple(torch.randn(b, h, s, d, dtype=torch.bfloat16, device=device) for _ in range(3))


# Eager flex_attention (its unfused path, which the eager column and the float32 reference run)
# materializes [B, H, S, S] scores in float32 several times (measured: some 20 bytes an element for
# the forward, up to 80 with the backward), which at S 16384 is more memory than a GPU has. Eager
# runs a block of queries at a time, each block's scores at most this many elements; the compilers
# trace the whole call.
EAGER_SCORES = 1 << 28


def _query_blocks(size) -> int:
    """How many blocks of queries eager runs: the fewest (a power of two) within EAGER_SCORES."""
    b, h, s, _ = size
    n = 1
    while n < s and b * h * math.ceil(s / n) * s > EAGER_SCORES:
        n *= 2
    return n


def _shift_score(score_mod, start: int):
    """score_mod of a block of queries starting at `start`: its query index is the whole sequence's."""
    if score_mod is None or start == 0:
        return score_mod
    return lambda score, b, h, q, kv: score_mod(score, b, h, q + start, kv)


def _shift_mask(mask_mod, start: int):
    return mask_mod if start == 0 else lambda b, h, q, kv: mask_mod(b, h, q + start, kv)


def _program(score_mod=None, mask_mod=None, mask_batch: bool = False):
    """A build function: flex_attention with this score_mod and a BlockMask of this mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def build(size, device):
        b, _, s, _ = size
        score = score_mod(size, device) if score_mod is not None else None
        mask = mask_mod(size, device) if mask_mod is not None else None
        mask_b = b if mask_batch else 1
        block_mask = create_block_mask(mask, mask_b, 1, s, s, device=device) if mask else None
        step = math.ceil(s / _query_blocks(size))
        # (start, end, score_mod, BlockMask) of each block of queries eager runs, made once here
        blocks = []
        for i in range(0, s, step) if step < s else ():
            j = min(i + step, s)
            shifted = create_block_mask(_shift_mask(mask, i), mask_b, 1, j - i, s, device=device) if mask else None
            blocks.append((i, j, _shift_score(score, i), shifted))

        def attention(q, k, v):
            if torch.compiler.is_compiling() or not blocks:
                return flex_attention(q, k, v, score_mod=score, block_mask=block_mask)
            parts = [flex_attention(q[:, :, i:j], k, v, score_mod=sm, block_mask=bm) for i, j, sm, bm in blocks]
            return torch.cat(parts, dim=2)

        return Built(attention, _qkv(size, device))

    return build


def _sliding(size, device):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv <= 256)

    return mask


def _alibi(size, device):
    heads = size[1]
    slopes = torch.exp2(-torch.arange(1, heads + 1, device=device, dtype=torch.float32) * 8.0 / heads)

    def score(s, b, h, q, kv):
        return s + slopes[h] * (kv - q)

    return score


def _documents(size, device):
    """Documents of random lengths packed into each sequence, the BlockMask made from their ids."""
    s = size[2]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, s // 8), max(2, s // 2), (16,), generator=gen)
    doc = torch.repeat_interleave(torch.arange(16), lengths)[:s]
    doc = torch.cat([doc, torch.full((s - doc.numel(),), 16)]).to(device)

    def mask(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return mask


def _relative(size, device):
    """T5's bucketed relative position bias: a [32, heads] table read by bucket and head."""
    table = torch.randn(32, size[1], device=device, dtype=torch.float32)

    def score(s, b, h, q, kv):
        rel = kv - q
        near = rel.abs()
        far = (8 + torch.log(near.float() / 8) / math.log(16) * 8).to(torch.int32).clamp(max=15)
        bucket = torch.where(near < 8, near, far) + (rel > 0).to(torch.int32) * 16
        return s + table[bucket, h]

    return score


def _sdpa_causal(size, device):
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return Built(attention, _qkv(size, device))


# name -> (build, sizes), at S 4096 on the GPU
_PROGRAMS = {
    "flex_causal": (_program(mask_mod=lambda size, device: causal), SIZES),
    "flex_causal_d128": (_program(mask_mod=lambda size, device: causal), SIZES_WIDE),
    "flex_sliding": (_program(mask_mod=_sliding), SIZES),
    "flex_alibi": (_program(score_mod=_alibi), SIZES),
    "flex_document": (_program(mask_mod=_documents), SIZES),
    "flex_relative": (_program(score_mod=_relative, mask_mod=lambda size, device: causal), SIZES),
    "flex_sdpa_causal": (_sdpa_causal, SIZES),
    "flex_sdpa_causal_d128": (_sdpa_causal, SIZES_WIDE),
}

# suffix -> the sequence length per scale. The small scales keep their rows cheap: the CPU's long
# row is S 1024 (twice the tokens of its S 512 row, as B cannot go below 1), not 16k.
LENGTHS = {"_s1k": {"gpu": 1024, "cpu": 128, "tiny": 64}, "_s16k": {"gpu": 16384, "cpu": 1024, "tiny": 256}}


def at_length(sizes: dict[str, tuple], lengths: dict[str, int]) -> dict[str, tuple]:
    """The sizes at other sequence lengths, the batch keeping the tokens a call (at least one sequence)."""
    return {scale: (max(1, b * s // lengths[scale]), h, lengths[scale], d) for scale, (b, h, s, d) in sizes.items()}


# Each program's rows together, the sequence growing: name_s1k, name, name_s16k.
PROGRAMS = {
    name + suffix: (build, at_length(sizes, LENGTHS[suffix]) if suffix else sizes)
    for name, (build, sizes) in _PROGRAMS.items()
    for suffix in ("_s1k", "", "_s16k")
}


def describe(size: tuple) -> str:
    b, h, s, d = size
    return f"B{b} H{h} S{s} D{d}"


__all__ = ["LENGTHS", "PROGRAMS", "at_length", "describe"]
