"""SDPA masks broadcast along their last dim are made contiguous (frontend/patterns.py: dense_sdpa_masks).

transformers' BERT hands SDPA such a mask under torch.compile; PyTorch's fused CUDA kernels refuse
it and SDPA falls to its math path. The rewrite only runs for CUDA graphs; these tests run it on
a CPU graph (devices=("cpu",)) to check the rewritten graph and that it computes the same."""

import torch
import torch.nn.functional as F

from ember.frontend.patterns import dense_sdpa_masks
from tests.helpers import dynamo_graph


def _attention(q, k, v, keep):
    mask = keep[:, None, :, None].expand(q.shape[0], 1, q.shape[2], k.shape[2])  # last-dim stride 0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _attention_positional(q, k, v, keep):
    mask = keep[:, None, None, :].expand(q.shape[0], 1, q.shape[2], k.shape[2])  # last dim unit-stride
    return F.scaled_dot_product_attention(q, k, v, mask)


def test_broadcast_last_dim_mask_is_made_contiguous():
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    keep = torch.rand(2, 8) > 0.3
    gm, inputs = dynamo_graph(_attention, q, k, v, keep)
    made = dense_sdpa_masks(gm, devices=("cpu",))
    assert len(made) == 1 and "contiguous" in made[0], made
    sdpa = next(n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)
    mask = sdpa.kwargs["attn_mask"]
    assert mask.op == "call_method" and mask.target == "contiguous", mask.format_node()
    assert mask.meta["example_value"].stride(-1) == 1
    torch.testing.assert_close(gm(*inputs)[0], _attention(q, k, v, keep))


def test_unit_stride_mask_and_cpu_graphs_are_left_alone():
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    keep = torch.rand(2, 8) > 0.3
    assert dense_sdpa_masks(dynamo_graph(_attention_positional, q, k, v, keep)[0], devices=("cpu",)) == []
    assert dense_sdpa_masks(dynamo_graph(_attention, q, k, v, keep)[0]) == []  # CUDA only by default


def _two_layers(q, k, v, keep):
    mask = keep[:, None, :, None].expand(q.shape[0], 1, q.shape[2], k.shape[2])
    h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(h, k, v, attn_mask=mask)


def test_one_dense_copy_per_mask():
    # BERT's layers share one mask: a copy per layer kept 12 of them (201 MB) alive at once.
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    keep = torch.rand(2, 8) > 0.3
    gm, inputs = dynamo_graph(_two_layers, q, k, v, keep)
    made = dense_sdpa_masks(gm, devices=("cpu",))
    sdpas = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
    copies = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous"]
    assert len(made) == 2 and len(sdpas) == 2 and len(copies) == 1, gm.graph
    assert all(n.kwargs["attn_mask"] is copies[0] for n in sdpas)
    torch.testing.assert_close(gm(*inputs)[0], _two_layers(q, k, v, keep))
