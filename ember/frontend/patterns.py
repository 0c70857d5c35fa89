"""The `attention` pass: attention written out by hand, rewritten to `F.scaled_dot_product_attention`.

Runs on Dynamo's Torch-level FX graph, *before* AOTAutograd, so that AOTAutograd traces SDPA's
forward and its own backward (flash / cuDNN / memory-efficient on CUDA, the fused CPU kernel on
CPU) instead of two batched matmuls and a softmax with the whole score matrix in memory. What is
matched, and when SDPA computes the same function, is attention_match.py's; this module rewrites
the matches and makes SDPA's broadcast masks dense for its fused CUDA kernels.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from ember import config, faults, log
from ember.frontend.attention_match import Rewrite, find_attention
from ember.frontend.constant_masks import constant_ancestors, sdpa_constant_mask
from ember.frontend.fx_nodes import call_arg, example_value, is_call, mutates


def attention_pass(gm: fx.GraphModule) -> list[Rewrite]:
    """The pass as the backend runs it: rewrite, log each rewrite (`EMBER_LOGS=patterns`).

    If matching fails unexpectedly the graph is left exactly as Dynamo gave it, with a warning
    (EMBER_STRICT=1 raises): the pass is an optimisation, never a reason not to compile.
    """
    try:
        faults.at("patterns")
        found = find_attention(gm)
    except Exception as e:
        if config.get("strict"):
            raise
        log.warn(f"ember: attention pattern matching failed, graph left as written: {type(e).__name__}: {e}")
        return []
    apply(gm, found)
    if found:
        log.artifact("patterns", f"{len(found)} attention rewrite(s)", lambda: "\n".join(rw.describe() for rw in found))
    folded = constant_sdpa_masks(gm)
    if folded:
        log.artifact("patterns", f"{len(folded)} constant SDPA mask(s) folded", lambda: "\n".join(folded))
    densified = dense_sdpa_masks(gm)
    if densified:
        log.artifact("patterns", f"{len(densified)} SDPA mask(s) made dense", lambda: "\n".join(densified))
    return found


def constant_sdpa_masks(gm: fx.GraphModule) -> list[str]:
    """SDPA calls whose `attn_mask` is built from constants only and keeps exactly the causal
    triangle become `is_causal=True` with no mask; a mask that keeps every score is dropped.

    transformers builds its causal mask in the graph under torch.compile (in eager it passes
    none where it can check the inputs' values, which tracing cannot): arange, compares and
    cumsum over position ids, with no graph input among them. With a mask, SDPA's flash kernel
    is ineligible and the memory-efficient one runs, with its bias read per score; with
    is_causal, flash (or cuDNN's) skips the masked half. Here the mask is evaluated once, when
    the graph is compiled (constant_masks.sdpa_constant_mask says what counts as causal), and
    the nodes that built it are erased where nothing else reads them."""
    folded, builders, memo = [], [], {}
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is F.scaled_dot_product_attention):
            continue
        mask = call_arg(node, 3, "attn_mask")
        if call_arg(node, 5, "is_causal", False) is not False or mask is None:
            continue
        kept = sdpa_constant_mask(node, memo)
        if kept is None:
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        if len(args) > 3:
            args[3] = None
        else:
            kwargs["attn_mask"] = None
        if kept == "causal":
            if len(args) > 5:
                args[5] = True
            else:
                kwargs["is_causal"] = True
        node.args, node.kwargs = tuple(args), kwargs
        builders += constant_ancestors(mask)
        folded.append(
            f"{node.name}: attn_mask {mask.name} keeps {'the causal triangle: is_causal=True' if kept == 'causal' else 'every score: dropped'}"
        )
    if folded:
        _erase_unread(gm.graph, builders)
        gm.graph.lint()
        gm.recompile()
    return folded


def _erase_unread(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase those of `nodes` (pure ones) that nothing reads any more, last first."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=lambda n: -position[n]):
        if not node.users and node.op in ("call_function", "call_method") and not mutates(node):
            graph.erase_node(node)


def dense_sdpa_masks(gm: fx.GraphModule, devices: tuple[str, ...] = ("cuda",)) -> list[str]:
    """SDPA on CUDA with a mask whose last dim is broadcast (stride 0) gets the mask made contiguous.

    PyTorch's fused kernels need the mask's last dim unit-stride; otherwise SDPA picks its math
    path, which AOTAutograd traces into matmuls and a softmax over the whole score matrix.
    transformers' BERT passes exactly such a mask under torch.compile ([B, 1, L, L], strides
    (0, L, 1, 0)); in eager it passes none (it checks the mask's values, which tracing cannot).
    Materializing the boolean mask writes B*L*L bytes; the math path moved several score
    matrices (B*H*L*L elements each) through memory.

    One dense copy per mask, shared by every SDPA that uses it: BERT's 12 layers pass the same
    mask, and a copy per layer kept 12 [32, 1, 512, 512] bf16 tensors (201 MB) alive at once
    (they were computed by one fused kernel at the first layer), so ember's inference peak on
    the H100 was 336 MB against eager's 277."""
    made = []
    dense_of: dict[fx.Node, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is F.scaled_dot_product_attention):
            continue
        mask = call_arg(node, 3, "attn_mask")
        q, m = example_value(node.args[0]) if node.args else None, example_value(mask)
        if q is None or m is None or q.device.type not in devices or not m.dim():
            continue
        if m.shape[-1] == 1 or m.stride(-1) == 1:
            continue
        dense = dense_of.get(mask)
        if dense is None:  # graph order: this is the mask's first SDPA, before all the others
            with gm.graph.inserting_before(node):
                dense = gm.graph.call_method("contiguous", (mask,))
            dense.meta["example_value"] = m.contiguous()
            dense_of[mask] = dense
        if len(node.args) > 3:
            node.args = (*node.args[:3], dense, *node.args[4:])
        else:
            node.kwargs = {**node.kwargs, "attn_mask": dense}
        made.append(f"{node.name}: attn_mask {tuple(m.shape)} strides {m.stride()} -> contiguous")
    if made:
        gm.graph.lint()
        gm.recompile()
    return made


def rewrite_attention(gm: fx.GraphModule) -> list[Rewrite]:
    """Rewrite every provable written-out attention in `gm` to SDPA; returns the rewrites made."""
    found = find_attention(gm)
    apply(gm, found)
    return found


def apply(gm: fx.GraphModule, found: list[Rewrite]) -> None:
    replaced: dict[fx.Node, fx.Node] = {}  # one attention's output may be another's q, k, v or mask
    for match in found:
        for name in ("q", "k", "k_t", "v", "mask_node"):
            setattr(match, name, replaced.get(getattr(match, name), getattr(match, name)))
        replaced[match.out] = _apply(gm.graph, match)
    if found:
        gm.graph.lint()
        gm.recompile()


# ---------------------------------------------------------------------------------------------
# Rewriting


def _apply(graph: fx.Graph, rw: Rewrite) -> fx.Node:
    out = rw.out
    with graph.inserting_before(out):
        # The fused kernels want the last dim contiguous; a transposed view would send SDPA to
        # its math fallback.
        q, v = _contiguous_last(graph, rw.q, example_value(rw.q)), _contiguous_last(graph, rw.v, example_value(rw.v))
        if rw.k is not None:
            k = _contiguous_last(graph, rw.k, example_value(rw.k))
        else:  # q @ k_t with k_t not a transpose: SDPA gets k_t.transpose(-2, -1)
            k = graph.call_method("transpose", (rw.k_t, -2, -1))
            k_t = example_value(rw.k_t)
            if k_t is not None and k_t.shape[-2] != 1 and k_t.stride(-2) != 1:
                k = graph.call_method("contiguous", (k,))
        kwargs: dict[str, Any] = {"scale": rw.scale}
        if rw.mask == "causal":
            kwargs["is_causal"] = True
        elif rw.mask == "additive":
            kwargs["attn_mask"] = rw.mask_node
        elif rw.mask == "bool":
            kwargs["attn_mask"] = (
                graph.call_function(torch.logical_not, (rw.mask_node,)) if rw.invert_mask else rw.mask_node
            )
        if rw.ndim == 3:
            q, k, v = (graph.call_method("unsqueeze", (t, 0)) for t in (q, k, v))
        new = graph.call_function(F.scaled_dot_product_attention, (q, k, v), kwargs)
        if rw.ndim == 3:
            new = graph.call_method("squeeze", (new, 0))
        if _layout_read(out):
            # SDPA's output is [B, L, H, E] in memory (a transposed view), the matmul's was
            # contiguous: code that relied on that (`.view`, a graph output) gets it back.
            new = graph.call_method("contiguous", (new,))
    new.meta.update({key: out.meta[key] for key in ("stack_trace", "nn_module_stack") if key in out.meta})
    out.replace_all_uses_with(new)
    # Erase what the rewrite left unread: the chain, the peeled scales and transposes, and a
    # constant mask that became is_causal. Only pure nodes, only when nothing else reads them.
    dead = [*rw.chain, *rw.peeled]
    if rw.mask == "causal":
        dead += constant_ancestors(rw.mask_node)
    _erase_unread(graph, dead)
    return new


_VIEW_METHODS = {"transpose", "permute", "squeeze", "unsqueeze", "expand", "__getitem__", "swapaxes", "swapdims"}
_VIEW_FUNCS = {operator.getitem, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze, getattr}


def _layout_read(node: fx.Node) -> bool:
    """Whether `node`'s strides matter downstream: a `.view` through views of it, or the graph output."""
    for user in node.users:
        if user.op == "output" or is_call(user, {torch.Tensor.view}, {"view"}):
            return True
        if is_call(user, _VIEW_FUNCS, _VIEW_METHODS) and _layout_read(user):
            return True
    return False


def _contiguous_last(graph: fx.Graph, node: fx.Node, value) -> fx.Node:
    if value is not None and value.dim() and value.shape[-1] != 1 and value.stride(-1) != 1:
        return graph.call_method("contiguous", (node,))
    return node
