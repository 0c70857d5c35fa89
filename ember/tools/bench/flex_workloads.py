"""FlexAttention workloads for `ember bench` (group `flex`): one attention call a step, bf16,
[B, H, S, D] query, key and value; each compiler compiles the same `flex_attention` program, and
`flex_sdpa_causal` is the same shapes through F.scaled_dot_product_attention (the fastest fused
kernel PyTorch picks on the machine), the bar for plain causal attention.

    ember bench --workloads flex                            # every row, inference and training
    ember bench --workloads flex_causal,flex_sdpa_causal --modes inference

The size is a tuple (B, H, S, D); the BlockMask, tables and document ids are built with the inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ember.tools.bench.built import Built

SIZES = {"gpu": (4, 16, 4096, 64), "cpu": (1, 4, 512, 64), "tiny": (1, 2, 128, 16)}
SIZES_WIDE = {"gpu": (4, 16, 4096, 128), "cpu": (1, 4, 512, 128), "tiny": (1, 2, 128, 32)}


def _qkv(size, device):
    b, h, s, d = size
    return tuple(torch.randn(b, h, s, d, dtype=torch.bfloat16, device=device) for _ in range(3))


def _causal(b, h, q, kv):
    return q >= kv


def _program(score_mod=None, mask_mod=None, mask_batch: bool = False):
    """A build function: flex_attention with this score_mod and a BlockMask of this mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def build(size, device):
        b, _, s, _ = size
        score = score_mod(size, device) if score_mod is not None else None
        mask = mask_mod(size, device) if mask_mod is not None else None
        block_mask = create_block_mask(mask, b if mask_batch else 1, 1, s, s, device=device) if mask else None

        def attention(q, k, v):
            return flex_attention(q, k, v, score_mod=score, block_mask=block_mask)

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


# name -> (build, sizes)
PROGRAMS = {
    "flex_causal": (_program(mask_mod=lambda size, device: _causal), SIZES),
    "flex_causal_d128": (_program(mask_mod=lambda size, device: _causal), SIZES_WIDE),
    "flex_sliding": (_program(mask_mod=_sliding), SIZES),
    "flex_alibi": (_program(score_mod=_alibi), SIZES),
    "flex_document": (_program(mask_mod=_documents), SIZES),
    "flex_relative": (_program(score_mod=_relative, mask_mod=lambda size, device: _causal), SIZES),
    "flex_sdpa_causal": (_sdpa_causal, SIZES),
    "flex_sdpa_causal_d128": (_sdpa_causal, SIZES_WIDE),
}


def describe(size: tuple) -> str:
    b, h, s, d = size
    return f"B{b} H{h} S{s} D{d}"


__all__ = ["PROGRAMS", "describe"]
