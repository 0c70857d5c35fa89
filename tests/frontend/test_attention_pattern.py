"""Attention written out by hand, through ember on the CPU, against eager PyTorch.

Table: one program per written form, the mask kind the rewrite must find (None: the pass must
leave it alone), dtypes. Outputs and the gradients of q, k, v are compared with eager: float32
directly; bfloat16 against an fp32 reference computed from the same bf16 inputs, with
compiled's error at most 2x eager's plus a little. A rewritten graph must run SDPA as one
extern each way (no bmm left); a graph left alone must not contain SDPA.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ember
from ember.frontend.attention_match import find_attention
from ember.frontend.backend import ember_backend
from tests.helpers import assert_close, assert_no_fallback, assert_not_worse, forward_backward, reports, repro

B, H, L, D = 2, 3, 16, 8
FP32, BF16 = torch.float32, torch.bfloat16


def _causal_keep(n: int) -> torch.Tensor:
    return torch.tril(torch.ones(n, n, dtype=torch.bool))


def _random_keep(shape) -> torch.Tensor:
    keep = torch.rand(shape) > 0.4
    return keep | torch.eye(shape[-1], dtype=torch.bool)  # no fully masked row (eager gives NaN there)


# --- the written forms ------------------------------------------------------------------------


def mul_scale(q, k, v):  # ember.tools.workloads.attention_manual
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    return torch.softmax(scores, dim=-1) @ v


def div_sqrt(q, k, v):
    return F.softmax(torch.matmul(q, k.mT) / math.sqrt(q.size(-1)), dim=-1).matmul(v)


def scale_q_first(q, k, v):
    q = q * (1.0 / math.sqrt(D))
    return (q @ k.transpose(2, 3)).softmax(-1) @ v


def scale_q_and_k(q, k, v):
    return torch.softmax((q * D**-0.25) @ (k * D**-0.25).transpose(-2, -1), -1) @ v


def additive_mask(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-2, -1) / 8.0 + mask, dim=-1) @ v


def bool_mask(q, k, v, keep):
    scores = (q @ k.transpose(-2, -1)) * 0.3
    return F.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def where_mask(q, k, v, keep):
    scores = torch.where(keep, q @ k.transpose(-2, -1), float("-inf")) / 3.0  # mask below the scale
    return scores.softmax(dim=-1) @ v


def where_drop_mask(q, k, v, keep):  # the fill in where's true branch: a "drop" condition, negated
    return torch.where(~keep, float("-inf"), q @ k.transpose(-2, -1) * 0.3).softmax(dim=-1) @ v


def causal_tril(q, k, v):
    n = q.size(-2)
    causal = torch.tril(torch.ones(n, n, device=q.device)).view(1, 1, n, n)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return F.softmax(scores.masked_fill(causal == 0, float("-inf")), dim=-1) @ v


def fp32_softmax(q, k, v):  # softmax through an fp32 cast, as mixed-precision code writes it
    scores = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool, device=q.device))
    probs = F.softmax(scores.masked_fill(~mask, float("-inf")).float(), dim=-1).to(q.dtype)
    return torch.matmul(F.dropout(probs, 0.1, training=False), v)


def softmax_dtype(q, k, v):
    return torch.softmax(q @ k.mT * 0.25, dim=-1, dtype=torch.float32).to(v.dtype) @ v


def bmm_3d(q, k, v):  # [B*H, L, D] as older code writes it
    q, k, v = (t.reshape(B * H, L, D) for t in (q, k, v))
    p = torch.bmm(q, k.transpose(1, 2)).div(math.sqrt(D)).softmax(dim=-1)
    return torch.bmm(p, v).view(B, H, L, D)


def merge_heads(q, k, v):  # the usual consumer: heads back into the channel dim
    y = torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1) @ v
    return y.transpose(1, 2).contiguous().view(B, L, H * D) * 2


def flat_view(q, k, v):  # .view relies on the matmul's contiguous result; SDPA's is transposed
    return (torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1) @ v).view(B * H * L, D) * 2


def causal_additive(q, k, v):  # a constant additive mask that is the causal one
    mask = torch.full((L, L), float("-inf"), device=q.device).triu(1)
    return torch.softmax(q @ k.transpose(-2, -1) * 0.3 + mask, dim=-1) @ v


def contiguous_kt(q, k, v):  # k^T materialized by the caller (older GPT-2 code keeps keys so)
    kt = k.transpose(-2, -1).contiguous()
    return torch.softmax(q @ kt * 0.3, dim=-1) @ v


def two_layers(q, k, v):  # one attention's output is the next one's query
    first = torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1) @ v
    return torch.softmax(first @ k.transpose(-2, -1) * 0.3, dim=-1) @ v


def llama_eager(q, k, v, mask):  # transformers' eager_attention_forward
    weights = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
    weights = weights + mask[:, :, :, : k.shape[-2]]
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = F.dropout(weights, p=0.0, training=True)
    return torch.matmul(weights, v).transpose(1, 2).contiguous()


class NanoGPTAttention(nn.Module):
    """nanoGPT's slow path: a tril buffer (contents unknown at compile time: a boolean mask)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(L, L)).view(1, 1, L, L))
        self.attn_dropout = nn.Dropout(0.1)

    def forward(self, q, k, v):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return self.attn_dropout(F.softmax(att, dim=-1)) @ v


# --- forms that must be left alone -------------------------------------------------------------


def softmax_dim0(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=0) @ v


def tensor_scale_reused(q, k, v, temperature):
    scale = temperature.rsqrt()  # not a constant, and read again below
    return torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1) @ v, scale * 2


def probs_returned(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1)
    return p @ v, p


def finite_fill(q, k, v, keep):  # -1e9 differs from SDPA on fully masked rows
    return F.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, -1e9), dim=-1) @ v


def mask_then_scale(q, k, v, mask):  # the mask is scaled too: not SDPA's formula
    return torch.softmax((q @ k.transpose(-2, -1) + mask) * 0.3, dim=-1) @ v


def live_dropout(q, k, v):  # SDPA's dropout would draw a different random stream
    return F.dropout(torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1), 0.5, training=True) @ v


def broadcast_k(q, k, v):  # one k/v head for all query heads: matmul broadcasts, we do not
    return torch.softmax(q @ k[:, :1].transpose(-2, -1) * 0.3, dim=-1) @ v[:, :1]


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    expect: tuple[str, ...]  # the mask kind of each rewrite; (): must be left alone
    extras: Callable = lambda dtype: ()  # inputs without gradients (masks)
    dtypes: tuple = (FP32,)
    random: bool = False  # output depends on RNG: check the rewrite decision only


CASES = [
    Case("mul_scale", mul_scale, ("none",), dtypes=(FP32, BF16)),
    Case("div_sqrt", div_sqrt, ("none",)),
    Case("scale_q_first", scale_q_first, ("none",)),
    Case("scale_q_and_k", scale_q_and_k, ("none",)),
    Case("additive_mask", additive_mask, ("additive",), lambda dt: (torch.randn(L, L, dtype=dt),), (FP32, BF16)),
    Case("bool_mask", bool_mask, ("bool",), lambda dt: (_random_keep((B, 1, L, L)),)),
    Case("where_mask", where_mask, ("bool",), lambda dt: (_random_keep((L, L)),)),
    Case("where_drop_mask", where_drop_mask, ("bool",), lambda dt: (_random_keep((B, 1, L, L)),)),
    Case("causal_tril", causal_tril, ("causal",), dtypes=(FP32, BF16)),
    Case("fp32_softmax", fp32_softmax, ("causal",), dtypes=(FP32, BF16)),
    Case("softmax_dtype", softmax_dtype, ("none",), dtypes=(BF16,)),
    Case("bmm_3d", bmm_3d, ("none",), dtypes=(FP32, BF16)),
    Case("merge_heads", merge_heads, ("none",)),
    Case("flat_view", flat_view, ("none",)),
    Case("causal_additive", causal_additive, ("causal",)),
    Case("contiguous_kt", contiguous_kt, ("none",)),
    Case("two_layers", two_layers, ("none", "none")),
    Case("llama_eager", llama_eager, ("additive",), lambda dt: (torch.randn(B, 1, L, L + 4, dtype=dt),), (FP32, BF16)),
    Case("nanogpt_eval", NanoGPTAttention().eval(), ("bool",)),
    Case("softmax_dim0", softmax_dim0, ()),
    Case("tensor_scale_reused", tensor_scale_reused, (), lambda dt: (torch.rand((), dtype=dt) + 1,)),
    Case("probs_returned", probs_returned, ()),
    Case("finite_fill", finite_fill, (), lambda dt: (_random_keep((L, L)),)),
    Case("mask_then_scale", mask_then_scale, (), lambda dt: (torch.randn(L, L, dtype=dt),)),
    Case("live_dropout", live_dropout, (), random=True),
    Case("broadcast_k", broadcast_k, ()),
]

SDPA_EXTERNS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


def _compile(fn, found: list, **options):
    """ember in strict mode on the C++ backend, recording what the attention pass finds."""

    def backend(gm, example_inputs):
        found.extend(rw.mask for rw in find_attention(gm))
        return ember_backend(gm, example_inputs, options={"strict": True, "backend": "cpp", **options})

    return torch.compile(fn, backend=backend)


def _run(fn, qkv, extras, dtype=None):
    qkv = [x.detach().to(dtype or x.dtype).requires_grad_(True) for x in qkv]
    extras = [x.to(dtype) if dtype is not None and x.is_floating_point() else x for x in extras]
    model = fn.float() if dtype is not None and isinstance(fn, nn.Module) else fn
    return forward_backward(lambda *a: model(*a, *extras), [], qkv, grad_seed=1, train=True)


@pytest.mark.parametrize(
    "case,dtype",
    [pytest.param(c, dt, id=f"{c.name}-{'fp32' if dt == FP32 else 'bf16'}") for c in CASES for dt in c.dtypes],
)
def test_written_attention(case: Case, dtype: torch.dtype):
    line = repro(case=case.name, dtype=dtype)
    qkv = [torch.randn(B, H, L, D, dtype=dtype) for _ in range(3)]
    extras = case.extras(dtype)
    found: list = []
    compiled = _compile(case.fn, found)
    with reports() as report:
        comp_out, comp_grads = _run(compiled, qkv, extras)
    assert tuple(found) == case.expect, f"rewrites found: {found}\n{line}"
    assert_no_fallback(report, line)
    externs = [e for g in report.graphs for e in g.externs]
    if case.expect:
        assert set(SDPA_EXTERNS) <= set(externs), f"externs {externs}\n{line}"
        assert not {"bmm", "mm", "matmul"} & set(externs), f"externs {externs}\n{line}"
    else:
        assert not set(externs) & set(SDPA_EXTERNS), f"externs {externs}\n{line}"
    if case.random:
        assert [tuple(o.shape) for o in comp_out] == [(B, H, L, D)], line
        return

    eager_out, eager_grads = _run(case.fn, qkv, extras)
    pairs = list(zip(comp_out + comp_grads, eager_out + eager_grads, strict=True))
    names = [f"output {i}" for i in range(len(comp_out))] + ["grad q", "grad k", "grad v"]
    if dtype == FP32:
        for what, (c, e) in zip(names, pairs, strict=True):
            assert_close(c, e, rtol=1e-5, atol=1e-5, what=what, line=line)
    else:
        ref_out, ref_grads = _run(case.fn, qkv, extras, dtype=FP32)
        for what, (c, e), r in zip(names, pairs, ref_out + ref_grads, strict=True):
            assert_not_worse(c, e, r, what=what, line=line)


def test_dynamic_sequence_length():
    """Symbolic sizes: one compile, two sequence lengths, SDPA both times."""
    found: list = []
    compiled = _compile(div_sqrt, found)
    for n in (16, 24):
        qkv = [torch.randn(B, H, n, D) for _ in range(3)]
        torch._dynamo.mark_dynamic(qkv[0], 2)
        torch._dynamo.mark_dynamic(qkv[1], 2)
        torch._dynamo.mark_dynamic(qkv[2], 2)
        line = repro(case="div_sqrt", seq=n, dynamic=True)
        comp = _run(compiled, qkv, [])
        eager = _run(div_sqrt, qkv, [])
        for c, e in zip(comp[0] + comp[1], eager[0] + eager[1], strict=True):
            assert_close(c, e, rtol=1e-5, atol=1e-5, what="output/grad", line=line)
    assert found and set(found) == {"none"}, found


def test_setting_turns_the_pass_off():
    qkv = [torch.randn(B, H, L, D) for _ in range(3)]
    compiled = torch.compile(mul_scale, backend="ember", options={"strict": True, "backend": "cpp", "patterns": False})
    with reports() as report:
        out = compiled(*qkv)
    externs = [e for g in report.graphs for e in g.externs]
    assert externs.count("bmm") == 2 and not set(externs) & set(SDPA_EXTERNS), externs
    assert_close(out, mul_scale(*qkv), rtol=1e-5, atol=1e-5, what="output", line=repro(patterns=False))


def test_rewrite_is_logged():
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("ember")
    logger.addHandler(handler)
    try:
        with ember.config.override(logs="patterns"):
            torch.compile(causal_tril, backend="ember", options={"strict": True, "backend": "cpp"})(
                *[torch.randn(B, H, L, D) for _ in range(3)]
            )
    finally:
        logger.removeHandler(handler)
    text = "\n".join(records)
    assert "patterns: 1 attention rewrite" in text and "mask=causal" in text, text
