"""SDPA masks built from constants only, folded where they keep the causal triangle or every score
(frontend/patterns.py: constant_sdpa_masks; what counts, constant_masks.sdpa_constant_mask).

transformers builds its causal mask in the graph under torch.compile; with that mask SDPA cannot
use flash attention. Each test checks the rewritten graph and that it computes what eager does."""

import pytest
import torch
import torch.nn.functional as F

from ember.frontend.patterns import constant_sdpa_masks
from tests.helpers import dynamo_graph


def _sdpa_node(gm):
    return next(n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)


def _positions_mask(q, k):
    """transformers' way: compare query and key positions (arange), broadcast over the batch."""
    L, S = q.shape[-2], k.shape[-2]
    q_idx = torch.arange(L)[None, None, :, None]
    kv_idx = torch.arange(S)[None, None, None, :]
    keep = kv_idx <= q_idx
    # packed-sequence check through cumsum, as transformers does: every position in one sequence
    positions = torch.arange(S).unsqueeze(0).expand(q.shape[0], -1)
    first = positions[:, :1] - 1
    seq_id = (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)
    same = seq_id[:, None, :, None] == seq_id[:, None, None, :]
    return (keep & same).expand(q.shape[0], 1, L, S)


def _bool_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_positions_mask(q, k))


def _dunder_causal(q, k, v):
    """The comparisons as methods, as torch 2.11's Dynamo records transformers' `==` on CUDA."""
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    keep = j.__le__(i).__and__(i.__eq__(i).__invert__().__invert__())
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _float_causal_min(q, k, v):
    keep = _positions_mask(q, k)
    mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _float_causal_finite(q, k, v):
    keep = _positions_mask(q, k)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, 0.0, -1e4))


def _sliding_window(q, k, v):
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (i - j < 3))


def _tril(q, k, v):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    )


def _keep_everything(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool))


def _tril_in_place(q, k, v):
    m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    m.tril_()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _set_in_place(q, k, v):
    m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    m[:, 5:] = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _written_through_a_view(q, k, v):
    m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    m.t().triu_()  # the transpose's upper triangle is the mask's lower one
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _mask_from_input(q, k, v, lengths):
    keep = torch.arange(k.shape[-2])[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def _qkv(L=8, S=8, requires_grad=False):
    q = torch.randn(2, 3, L, 4, requires_grad=requires_grad)
    k = torch.randn(2, 3, S, 4, requires_grad=requires_grad)
    v = torch.randn(2, 3, S, 4, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize(
    "fn", [_bool_causal, _dunder_causal, _float_causal_min], ids=["bool", "operator-methods", "float-finfo-min"]
)
def test_a_constant_causal_mask_becomes_is_causal(fn):
    q, k, v = _qkv()
    gm, inputs = dynamo_graph(fn, q, k, v)
    folded = constant_sdpa_masks(gm)
    assert len(folded) == 1 and "is_causal=True" in folded[0], folded
    sdpa = _sdpa_node(gm)
    assert sdpa.kwargs.get("attn_mask") is None and sdpa.kwargs.get("is_causal") is True, sdpa.format_node()
    # the mask's builders are gone: nothing but the SDPA call and the output reads q, k, v
    assert not any(n.target in (torch.arange, torch.diff) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*inputs)[0], fn(q, k, v))


def test_a_mask_that_keeps_every_score_is_dropped():
    q, k, v = _qkv()
    gm, inputs = dynamo_graph(_keep_everything, q, k, v)
    folded = constant_sdpa_masks(gm)
    assert len(folded) == 1 and "dropped" in folded[0], folded
    sdpa = _sdpa_node(gm)
    assert sdpa.kwargs.get("attn_mask") is None and not sdpa.kwargs.get("is_causal"), sdpa.format_node()
    torch.testing.assert_close(gm(*inputs)[0], _keep_everything(q, k, v))


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (_sliding_window, (8, 8)),  # constant, but not causal
        (_float_causal_finite, (8, 8)),  # -1e4 is not "masked": a score could outweigh it
        (_tril, (4, 8)),  # not square: is_causal would align the triangle top-left
        # written in place after it is built: the nodes that build it read it before the write
        (_tril_in_place, (8, 8)),
        (_set_in_place, (8, 8)),
        (_written_through_a_view, (8, 8)),
    ],
    ids=["sliding-window", "finite-fill", "rectangular", "tril_", "setitem", "through-a-view"],
)
def test_other_constant_masks_stay(fn, shapes):
    q, k, v = _qkv(*shapes)
    gm, inputs = dynamo_graph(fn, q, k, v)
    assert constant_sdpa_masks(gm) == []
    assert _sdpa_node(gm).kwargs.get("attn_mask") is not None
    torch.testing.assert_close(gm(*inputs)[0], fn(q, k, v))


def test_a_compiled_mask_written_in_place_matches_eager():
    q, k, v = _qkv()
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(_set_in_place, backend="ember")(q, k, v), _set_in_place(q, k, v))


def test_a_broadcast_mask_is_bounded_by_its_storage():
    """transformers' mask at batch 80 × 512 tokens, [80, 1, 512, 512]: 21 MB of booleans, under the
    64 MiB a value evaluated at compile time may hold (constant_masks._MAX_CONST_BYTES)."""
    q = torch.randn(80, 1, 512, 2)
    gm, _ = dynamo_graph(_bool_causal, q, q, q)
    assert len(constant_sdpa_masks(gm)) == 1


def test_torch_tril_folds_on_a_square_score_matrix_only():
    q, k, v = _qkv(8, 8)
    gm, inputs = dynamo_graph(_tril, q, k, v)
    assert len(constant_sdpa_masks(gm)) == 1
    torch.testing.assert_close(gm(*inputs)[0], _tril(q, k, v))
    gm, _ = dynamo_graph(_tril, *_qkv(4, 8))
    assert constant_sdpa_masks(gm) == []


def test_a_mask_built_from_an_input_stays():
    q, k, v = _qkv()
    gm, _ = dynamo_graph(_mask_from_input, q, k, v, torch.tensor([5, 8]))
    assert constant_sdpa_masks(gm) == []


def test_a_compiled_training_step_through_a_folded_mask_matches_eager(monkeypatch):
    from ember.frontend import patterns

    folded = []
    fold = patterns.constant_sdpa_masks
    monkeypatch.setattr(patterns, "constant_sdpa_masks", lambda gm: folded.extend(fold(gm)) or folded)
    q, k, v = _qkv(requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(_bool_causal, backend="ember")
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = _bool_causal(q, k, v)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert len(folded) == 1 and "is_causal=True" in folded[0], folded


def test_transformers_causal_lm_masks_fold():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 12))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(ids)
    folded = [f for gm in graphs for f in constant_sdpa_masks(gm)]
    assert folded and all("is_causal=True" in f for f in folded), folded
