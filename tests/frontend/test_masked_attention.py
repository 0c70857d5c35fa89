"""SDPA with a mask tensor, or causal without one, in a graph that needs gradients, compiled for
Triton, runs as ember's FlexAttention kernels over a BlockMask computed from the mask or the lengths
(frontend/masked_attention.py): output and gradients against eager SDPA through Triton's
interpreter, for boolean and additive masks, causal calls, broadcast dims, GQA, cross attention and
lengths no multiple of the blocks; and the calls it leaves to SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.frontend.masked_attention import BLOCK, causal_blocks, flex_for_sdpa, mask_blocks
from tests.helpers import assert_close, assert_no_fallback, dynamo_graph, ember_compile, reports, repro


@pytest.fixture(autouse=True)
def interpreter_tiles():
    """Triton's interpreter pays per operation, not per element: the float32 kernels run here over 64 x 64
    tiles, far fewer programs and steps than the GPU's (16 x 16 in the backward, 32 x 64 in the forward; the
    tiles are the kernels' parameters: tests/e2e/test_flex_attention.py runs the GPU's, and the
    block-by-block walk)."""
    with ember.config.override(heuristics="flex.float32=64x64x4,flex.backward_float32=64x64x4"):
        yield


def _mask(kind: str, shape: tuple[int, ...], length: int, keys: int) -> torch.Tensor:
    """A mask of `shape` whose last two dims are (length, keys) or broadcast: causal over the keys'
    first part, some random holes, one query row removed entirely."""
    keep = torch.ones(length, keys, dtype=torch.bool).tril(keys - length) & (
        torch.rand(*shape[:-2], length, keys) > 0.2
    )
    keep[..., 1, :] = False  # a row with nothing to attend: 0, as SDPA's reference gives
    if shape[-2] == 1:
        keep = keep[..., :1, :]
    if kind == "bool":
        return keep.contiguous()
    bias = torch.randn(keep.shape)
    return bias.masked_fill(~keep, float("-inf") if kind == "-inf" else torch.finfo(torch.float32).min)


def _causal_blocks_removed(kind: str, shape, length: int, keys: int) -> torch.Tensor:
    """A causal mask over 300 tokens (blocks of 128: full, partial and empty ones) whose query rows
    128-255 are removed entirely."""
    keep = torch.ones(length, keys, dtype=torch.bool).tril().expand(*shape[:-2], length, keys).clone()
    keep[..., 128:256, :] = False
    if kind == "bool":
        return keep
    return torch.randn(keep.shape).masked_fill(~keep, float("-inf"))


CASES = {
    # name: (mask kind, mask shape as (dims of B, H, L, S, 1 = broadcast), B, H, H_kv, L, S, D)
    "bool_batch": ("bool", "B1LS", 2, 2, 2, 80, 80, 16),
    "bool_2d_gqa": ("bool", "LS", 1, 4, 2, 48, 48, 16),
    "bool_cross_rows_broadcast": ("bool", "B11S", 2, 2, 2, 40, 72, 16),
    "additive_inf_heads": ("-inf", "1HLS", 1, 2, 2, 64, 64, 16),
    "additive_finite_min": ("min", "B1LS", 2, 2, 2, 40, 40, 16),
    "bool_blocks_full_and_empty": ("bool", "11LS", 1, 2, 1, 300, 300, 16),
    "additive_blocks_full_and_empty": ("-inf", "1HLS", 1, 2, 2, 300, 300, 16),
}


def _shape(spec: str, B: int, H: int, L: int, S: int) -> tuple[int, ...]:
    return tuple({"B": B, "H": H, "L": L, "S": S, "1": 1}[c] for c in spec)


@pytest.mark.parametrize("name", sorted(CASES))
def test_masked_sdpa_training_matches_eager_through_flex_kernels(name):
    kind, spec, B, H, H_kv, L, S, D = CASES[name]
    torch.manual_seed(0)
    make = _causal_blocks_removed if L == 300 else _mask
    mask = make(kind, _shape(spec, B, H, L, S), L, S)
    q = torch.randn(B, H, L, D, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, D, requires_grad=True) for _ in range(2))
    gqa = H != H_kv

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa) * 2

    line = repro(case=name, backend="triton", shape=(B, H, H_kv, L, S, D), mask=tuple(mask.shape))
    out = fn(q, k, v, mask)
    grad = torch.randn_like(out)
    want = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]
    with reports() as report:
        out = ember_compile(fn, "triton")(q, k, v, mask)
        got = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]
    assert_no_fallback(report, line)
    hosts = "\n".join(g.host_source for g in report.graphs)
    assert "flex_attention_kernel" in hosts and "flex_attention_backward_kernel" in hosts, line
    assert "efficient_attention" not in hosts, line
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, b, rtol=1e-4, atol=1e-5, what=what, line=line)


# name: (B, H, H_kv, L, S, D); L > S and L < S: SDPA's causal mask is aligned to the top left
CAUSAL = {
    "causal": (2, 2, 2, 72, 72, 16),
    "causal_gqa": (1, 4, 2, 48, 48, 16),
    "causal_blocks_full_and_partial": (1, 2, 1, 300, 300, 16),
    "causal_more_queries": (1, 2, 2, 140, 100, 16),
    "causal_more_keys": (1, 2, 2, 100, 140, 16),
    "causal_scaled": (1, 2, 2, 130, 130, 16),
}


@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_causal_sdpa_training_matches_eager_through_flex_kernels(name):
    B, H, H_kv, L, S, D = CAUSAL[name]
    torch.manual_seed(0)
    q = torch.randn(B, H, L, D, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, D, requires_grad=True) for _ in range(2))
    gqa = H != H_kv

    scale = 0.3 if name == "causal_scaled" else None

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale) * 2

    line = repro(case=name, backend="triton", shape=(B, H, H_kv, L, S, D))
    out = fn(q, k, v)
    grad = torch.randn_like(out)
    want = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]
    with reports() as report:
        out = ember_compile(fn, "triton", sdpa_causal_flex=True)(q, k, v)
        got = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]
    assert_no_fallback(report, line)
    hosts = "\n".join(g.host_source for g in report.graphs)
    assert "flex_attention_kernel" in hosts and "flex_attention_backward_kernel" in hosts, line
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, b, rtol=1e-4, atol=1e-5, what=what, line=line)


@pytest.mark.parametrize("lengths", [(300, 300), (BLOCK * 2, BLOCK * 2), (140, 100), (100, 300)])
def test_causal_blocks_equal_those_of_the_causal_mask(lengths):
    """The blocks computed from the lengths alone list what mask_blocks lists for SDPA's causal mask."""
    L, S = lengths
    q, k = torch.empty(1, 1, L, 1), torch.empty(1, 1, S, 1)
    causal = torch.ones(L, S, dtype=torch.bool).tril()
    for ours, theirs in zip(causal_blocks(q, k), mask_blocks(causal, q, k)):
        assert ours.shape == theirs.shape, lengths
        if ours.dim() == theirs.dim() == 3:  # counts
            assert torch.equal(ours, theirs), lengths
    ours, theirs = causal_blocks(q, k), mask_blocks(causal, q, k)
    for idx, num in ((1, 0), (3, 2), (5, 4), (7, 6)):  # each list's listed entries, in any order
        for row in range(ours[num].numel()):
            n = int(ours[num].flatten()[row])
            a = sorted(ours[idx].flatten(0, -2)[row, :n].tolist())
            assert a == sorted(theirs[idx].flatten(0, -2)[row, :n].tolist()), (lengths, idx, row)


def test_mask_blocks_lists_partial_and_full_blocks_both_ways():
    """Blocks the mask removes entirely are listed nowhere, full ones apart from partial ones, past
    the sequence counts as removed; the query side lists the same blocks by column."""
    L, S = BLOCK * 2, BLOCK * 3 - 5  # the last column of blocks is cut short: never full
    keep = torch.zeros(1, 1, L, S, dtype=torch.bool)
    keep[..., :BLOCK, :BLOCK] = True  # full
    keep[..., BLOCK:, 7] = True  # partial, in row 1 column 0
    keep[..., :, 2 * BLOCK :] = True  # partial (cut short), rows 0 and 1
    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = mask_blocks(
        keep, torch.empty(1, 1, L, 1), torch.empty(1, 1, S, 1)
    )
    assert kv_num.flatten().tolist() == [1, 2] and full_num.flatten().tolist() == [1, 0]
    assert kv_idx[0, 0, 0, :1].tolist() == [2] and sorted(kv_idx[0, 0, 1, :2].tolist()) == [0, 2]
    assert full_idx[0, 0, 0, :1].tolist() == [0]
    assert q_num.flatten().tolist() == [1, 0, 2] and full_q_num.flatten().tolist() == [1, 0, 0]
    assert q_idx[0, 0, 0, :1].tolist() == [1] and full_q_idx[0, 0, 0, :1].tolist() == [0]


def test_mask_blocks_query_side_as_torchs_own_transpose():
    """The query-side lists mask_blocks gives, against those BlockMask.from_kv_blocks derives from
    its key-side lists."""
    from torch.nn.attention.flex_attention import BlockMask

    torch.manual_seed(0)
    L, S = 3 * BLOCK + 9, 2 * BLOCK + 40
    keep = torch.rand(2, 1, L, S) > 0.5
    keep[0, :, : 2 * BLOCK, :BLOCK] = True
    keep[1, :, BLOCK:, :] = False
    q, k = torch.empty(1, 1, L, 1), torch.empty(1, 1, S, 1)
    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = mask_blocks(keep, q, k)
    torch_own = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, seq_lengths=(L, S))
    for ours, num, theirs, their_num in (
        (q_idx, q_num, torch_own.q_indices, torch_own.q_num_blocks),
        (full_q_idx, full_q_num, torch_own.full_q_indices, torch_own.full_q_num_blocks),
    ):
        assert torch.equal(num, their_num)
        for row in range(num.numel()):
            n = int(num.flatten()[row])
            assert sorted(ours.flatten(0, -2)[row, :n].tolist()) == sorted(theirs.flatten(0, -2)[row, :n].tolist())


def _rewritten(fn, *args, causal: bool = True) -> list[str]:
    gm, _ = dynamo_graph(fn, *args)
    return flex_for_sdpa(gm, causal=causal)


def test_calls_left_to_sdpa():
    q = torch.randn(1, 2, 32, 16)
    bool_mask = torch.rand(32, 32) > 0.5
    grad_mask = torch.randn(32, 32, requires_grad=True)
    assert _rewritten(lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m), q, bool_mask)
    assert _rewritten(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), q)
    assert not _rewritten(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), q, causal=False)
    assert not _rewritten(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1), q)
    assert not _rewritten(lambda q: F.scaled_dot_product_attention(q, q, q), q)  # flash attention takes it
    wide = torch.randn(1, 2, 32, 256)  # causal above the head size ember's kernels were measured at
    assert not _rewritten(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), wide)
    assert _rewritten(lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m), wide, bool_mask)
    assert not _rewritten(lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m), q, grad_mask)
    assert not _rewritten(
        lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m, dropout_p=0.1), q, bool_mask
    )

    def written_between(q, m):
        m = m.clone()
        first = F.scaled_dot_product_attention(q, q, q, attn_mask=m)
        m[..., :8] = False
        return first + F.scaled_dot_product_attention(q, q, q, attn_mask=m)

    assert not _rewritten(written_between, q, bool_mask)


def test_float32_causal_on_cuda_keeps_sdpa():
    """A float32 causal call on CUDA keeps SDPA's memory-efficient kernel; a bfloat16 one is rewritten (the
    graph traced on the CPU, its example values then made CUDA's, as Dynamo records them there)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def on_cuda(dtype):
        gm, _ = dynamo_graph(
            lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), torch.randn(1, 2, 32, 16)
        )
        with FakeTensorMode():
            for node in gm.graph.nodes:
                value = node.meta.get("example_value")
                if isinstance(value, torch.Tensor):
                    node.meta["example_value"] = torch.empty(value.shape, dtype=dtype, device="cuda")
        return flex_for_sdpa(gm, causal=True)

    assert not on_cuda(torch.float32)
    assert on_cuda(torch.bfloat16) and on_cuda(torch.float16)


def test_inference_graphs_and_the_setting_keep_sdpa():
    q = torch.randn(1, 2, 32, 16, requires_grad=True)
    mask = torch.rand(32, 32) > 0.5

    def fn(q, m):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=m)

    for grad, setting in ((False, True), (True, False)):
        with torch.set_grad_enabled(grad), reports() as report:
            ember_compile(fn, "triton", sdpa_masked_flex=setting)(q, mask)
        hosts = "\n".join(g.host_source for g in report.graphs)
        assert "flex_attention" not in hosts, (grad, setting)


def test_masked_sdpa_training_under_dynamic_sizes():
    """The second length makes Dynamo's graph symbolic in it: the BlockMask's block counts are then
    computed from sizes known only at run time (ceiling divisions of the length)."""

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    compiled = ember_compile(fn, "triton", dynamic=None)
    for S in (40, 56, 136):
        torch.manual_seed(S)
        q, k, v = (torch.randn(1, 2, S, 16, requires_grad=True) for _ in range(3))
        mask = torch.rand(1, 1, S, S) > 0.3
        line = repro(case="dynamic", backend="triton", S=S)
        out = fn(q, k, v, mask)
        grad = torch.randn_like(out)
        want = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]
        with reports() as report:
            out = compiled(q, k, v, mask)
            got = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]
        assert_no_fallback(report, line)
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, rtol=1e-4, atol=1e-5, what=what, line=line)
