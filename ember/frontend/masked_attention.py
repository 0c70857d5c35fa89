"""SDPA with a mask tensor or `is_causal`, in a graph that needs gradients on Triton -> FlexAttention.

Runs on Dynamo's Torch-level FX graph, before AOTAutograd. PyTorch's SDPA kernels fit training
badly where cuDNN's is excluded (frontend/attention_backward.py says why):

- A call with `attn_mask`: flash attention takes no mask, so it traces into the memory-efficient
  kernel, which reads the mask at every score of every block, masked or not. Where a mask crosses a
  graph break (transformers' OPT builds its causal mask in a graph of its own) the constant fold
  (frontend/constant_masks.py) cannot see that it is causal, and the training step pays for it: on
  an H100, OPT's attention took 10.8 ms a step against cuDNN's 4.1.
- A causal call (`is_causal=True`, no mask) traces into flash attention, whose forward and backward
  took 2.05 ms of device time a step at 4096 tokens (B4 H16 D64, bf16, H200) where ember's FlexAttention
  kernels over a causal BlockMask took 1.59 (3.57 against 2.81 at head size 128; 0.74 against 0.70 at 1024
  tokens, B16).

Such a call becomes `flex_attention` (ember's own flash-attention kernel, forward and backward):
masked calls (setting `sdpa_masked_flex`) and causal ones (setting `sdpa_causal_flex`). The calls the
rewrite adds are to this module's functions, which AOTAutograd's cache refuses unless they are marked
(`_keyed`): marked, a warm start loads the graph as it loads any other.

A masked call's BlockMask is computed from the mask's values at run time: a block of scores the
mask removes entirely is skipped, one it keeps entirely is computed without reading the mask, and
only the blocks in between read it. A boolean mask becomes the `mask_mod` `mask[b, h, q, kv]`; a
floating mask (added to the scores) becomes the `score_mod` `score + mask[b, h, q, kv]`, its blocks
of -inf skipped. A row the mask removes entirely gives 0, as SDPA's `_safe_softmax` does; a row an
additive mask removes with a finite value (transformers' float32 lowest) gives the mean of the
values, as SDPA's kernels do, and its gradients match theirs (whose log-sum-exp absorbs log(keys) at
that magnitude, as ember's does), not those of a softmax computed exactly. A causal call's BlockMask
comes from the lengths alone (`causal_blocks`), its `mask_mod` `q_idx >= kv_idx` (SDPA's causal
mask is aligned to the top left, as this one).

Left as SDPA: a mask that needs a gradient (ember's FlexAttention backward has no gradient for a
captured tensor), dropout, `is_causal` with a mask, head counts or head sizes known only at run time, causal calls of
head size above 128, float32 causal calls on CUDA (SDPA's memory-efficient kernel is the faster there), and graphs
that need no gradient (there cuDNN's forward takes the mask).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import fx

from ember import config, log
from ember.frontend.fx_nodes import aliases, call_arg, example_value, mutates

# The BlockMask's blocks: the flex kernels' tiles divide it.
BLOCK = 128
# An additive mask's finite values below this count as it: the kernels scale scores by log2(e) after the
# score function, and transformers' "removed" value, float32's lowest, would overflow to -inf there,
# turning a row removed entirely into zeros where SDPA averages it (its scores all equal). Scores
# stay absorbed by it as by the lowest value, so every other row computes exactly as before.
MASK_FLOOR = torch.finfo(torch.float32).min / 2
# Causal calls are rewritten up to this head size, where ember's kernels were measured faster than flash
# attention in training (64 and 128 on an H200); above it flash attention stays (a masked call has no such
# kernel to keep: flash takes no mask).
CAUSAL_MAX_HEAD_SIZE = 128


def masked_attention_pass(gm: fx.GraphModule, example_inputs) -> fx.GraphModule | None:
    """The pass as the backend runs it: where `gm` may need gradients and compiles for Triton,
    rewrite its masked SDPA calls; log each (`EMBER_LOGS=patterns`). Returns `gm` as it was where it
    rewrote it (what runs if ember falls back: SDPA, not PyTorch's dense FlexAttention), else None."""
    from ember.frontend.attention_backward import graph_on_cuda, may_need_gradients

    masked, causal = config.get("sdpa_masked_flex"), config.get("sdpa_causal_flex")
    if not (masked or causal) or not may_need_gradients(gm, example_inputs):
        return None
    backend = config.get("backend")
    if backend == "cpp" or (backend != "triton" and not graph_on_cuda(gm, example_inputs)):
        return None
    if not any(_rewritable(n, masked, causal) for n in gm.graph.nodes):
        return None
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    original = fx.GraphModule(gm, graph)
    made = flex_for_sdpa(gm, masked, causal)
    if not made:
        return None
    log.artifact("patterns", f"{len(made)} masked or causal SDPA call(s) as flex_attention", lambda: "\n".join(made))
    return original


def flex_for_sdpa(gm: fx.GraphModule, masked: bool = True, causal: bool = False) -> list[str]:
    """Rewrite each SDPA call of `gm` that takes a mask tensor (`masked`), or is causal without one
    (`causal`), and that the rules above allow (the caller has decided that the graph needs gradients
    and compiles for Triton)."""
    made = []
    blocks_of: dict[tuple, fx.Node] = {}
    written = _written_in_place(gm.graph)
    for node in list(gm.graph.nodes):
        if not _rewritable(node, masked, causal):
            continue
        mask = call_arg(node, 3, "attn_mask")
        reason = "a mask the graph writes in place" if mask is not None and mask in written else _refusal(node)
        if reason is not None:
            log.artifact("patterns", f"{node.name}: SDPA with a mask or is_causal kept", reason)
            continue
        q, k, v = node.args[:3]
        query = example_value(q)
        scale = call_arg(node, 6, "scale")
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        key = (mask, str(query.shape[2]), str(example_value(k).shape[2]))  # (symbols under dynamic shapes)
        with gm.graph.inserting_before(node):
            blocks = blocks_of.get(key)
            if blocks is None:  # graph order: the mask's (or the lengths') first SDPA call
                made_blocks = (mask_blocks, (mask, q, k)) if mask is not None else (causal_blocks, (q, k))
                blocks = blocks_of[key] = _keyed(gm.graph.call_function(*made_blocks))
            if mask is not None:
                new = gm.graph.call_function(masked_flex_attention, (q, k, v, mask, blocks, scale))
            else:
                new = gm.graph.call_function(causal_flex_attention, (q, k, v, blocks, scale))
        new.meta.update(node.meta)
        _keyed(new)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        if mask is not None:
            m = example_value(mask)
            what = f"attn_mask {tuple(m.shape)} {str(m.dtype).replace('torch.', '')}"
        else:
            what = "is_causal"
        made.append(f"{node.name}: {what} -> flex_attention")
    if made:
        gm.graph.lint()
        gm.recompile()
    return made


def _keyed(node: fx.Node) -> fx.Node:
    """Mark a call to one of this module's functions as one AOTAutograd's cache may key: its check
    refuses calls to Python functions it does not know, unless marked as wrapped with a hash of their
    code. The hash is of ember's source; AOTAutograd's key holds ember's identity anyway, through the
    tag frontend/aot_cache.py adds."""
    from ember.runtime.cache import ember_source_digest

    node.meta["is_wrapped"] = True
    node.meta["user_cache_hash"] = ember_source_digest()
    return node


def _rewritable(node: fx.Node, masked: bool, causal: bool) -> bool:
    """An SDPA call with a mask tensor (where `masked`), or causal without one (where `causal`)."""
    if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
        return False
    mask = call_arg(node, 3, "attn_mask")
    if isinstance(mask, fx.Node):
        return masked
    return causal and mask is None and call_arg(node, 5, "is_causal", False) is True


def _written_in_place(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose memory the graph may write in place: what an in-place call writes, and every node
    sharing its memory through views. The flex op keeps its mask for the backward and the BlockMask
    is computed once, so a mask written between attention calls must stay SDPA's."""
    written: set[fx.Node] = set()
    for node in graph.nodes:
        if mutates(node) and node.args and isinstance(node.args[0], fx.Node):
            stack = [node.args[0], node]
            while stack:
                n = stack.pop()
                if n in written:
                    continue
                written.add(n)
                if aliases(n) and n.args and isinstance(n.args[0], fx.Node):
                    stack.append(n.args[0])
                stack += [u for u in n.users if (aliases(u) or mutates(u)) and u.args and u.args[0] is n]
    return written


def _refusal(node: fx.Node) -> str | None:
    """Why this SDPA call stays SDPA, or None."""
    if len(node.args) < 3 or not all(isinstance(a, fx.Node) for a in node.args[:3]):
        return "query, key or value not a tensor"
    mask = call_arg(node, 3, "attn_mask")
    dropout = call_arg(node, 4, "dropout_p", 0.0)
    if not isinstance(dropout, (int, float)) or dropout != 0:
        return f"dropout_p={dropout}"
    if mask is not None and call_arg(node, 5, "is_causal", False) is not False:
        return "is_causal with a mask"
    scale = call_arg(node, 6, "scale")
    if scale is not None and not isinstance(scale, (int, float)):
        return "a scale computed in the graph"
    gqa = call_arg(node, 7, "enable_gqa", False)
    if not isinstance(gqa, bool):
        return "enable_gqa computed in the graph"
    q, k, v = (example_value(a) for a in node.args[:3])
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "no example values"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "query, key and value not of 4 dims"
    if not all(isinstance(s, int) for t in (q, k, v) for s in (t.shape[1], t.shape[3])):
        return "head counts or head sizes known only at run time"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype}"
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        return "keys or values broadcast over the batch"
    if q.shape[1] % k.shape[1] or k.shape[-1] != q.shape[-1] or (q.shape[1] != k.shape[1] and not gqa):
        return "head counts or sizes that FlexAttention does not take"
    if mask is None and max(q.shape[-1], v.shape[-1]) > CAUSAL_MAX_HEAD_SIZE:
        return f"causal, head size above {CAUSAL_MAX_HEAD_SIZE}: flash attention's kernel is kept"
    # float32 causal calls on CUDA keep SDPA's memory-efficient kernel: ember's float32 flex kernels compute their
    # products in full precision off the tensor cores, and a config-built Llama's float32 training step (H200)
    # took 305.6 ms with them against 255.4 with SDPA's kernel (docs/decisions.md). Elsewhere, Triton's
    # interpreter among them, the rewrite stands: nothing faster to keep. (Masked float32 calls were not
    # measured against SDPA's kernel, which reads the mask at every score: they are rewritten.)
    if mask is None and q.dtype == torch.float32 and q.device.type == "cuda":
        return "causal in float32 on CUDA: the memory-efficient kernel is kept"
    return None if mask is None else _mask_refusal(example_value(mask), q, k)


def _mask_refusal(m, q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why a mask keeps its SDPA call, or None."""
    if not isinstance(m, torch.Tensor):
        return "no example values"
    if m.dim() > 4:
        return "a mask of more than 4 dims"
    if m.requires_grad:
        return "a mask that needs a gradient"
    if m.dtype != torch.bool and not m.dtype.is_floating_point:
        return f"a mask of {m.dtype}"
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    padded = (1,) * (4 - m.dim()) + tuple(m.shape)
    if any(not (_is_one(a) or a is b or a == b) for a, b in zip(padded, shape)):
        return f"a mask of {tuple(m.shape)} not broadcast to {shape}"
    return None


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def mask_blocks(mask, query, key) -> tuple[torch.Tensor, ...]:
    """The BlockMask's tensors for `mask` (up to 4 dims) over the queries of `query` and the keys of
    `key` (their sizes only): per row of blocks, the count and columns of partial blocks, then of
    full ones; per column of blocks, the same over rows. One call per mask, whatever number of
    attention calls read it."""
    length, keys = query.shape[2], key.shape[2]
    mask = _four_dims(mask)
    kept = mask if mask.dtype == torch.bool else mask != float("-inf")
    batch, heads = kept.shape[:2]
    kept = kept.expand(batch, heads, length, keys)
    rows, cols = -(-length // BLOCK), -(-keys // BLOCK)
    kept = F.pad(kept.to(torch.int8), (0, cols * BLOCK - keys, 0, rows * BLOCK - length))
    counts = kept.view(batch, heads, rows, BLOCK, cols, BLOCK).sum((3, 5), dtype=torch.int32)
    full = counts == BLOCK * BLOCK
    states = torch.stack(((counts > 0) & ~full, full))  # [2, batch, heads, rows, cols]: partial, full
    return _block_lists(states)


def causal_blocks(query, key) -> tuple[torch.Tensor, ...]:
    """The BlockMask's tensors (as mask_blocks') of the causal mask `q_idx >= kv_idx` over the queries
    of `query` and the keys of `key`, from their lengths alone: a block is full where its every query
    follows its every key within the sequences, partial where some query does."""
    length, keys = query.shape[2], key.shape[2]
    rows, cols = -(-length // BLOCK), -(-keys // BLOCK)
    row = torch.arange(rows, device=query.device).view(rows, 1) * BLOCK
    col = torch.arange(cols, device=query.device).view(1, cols) * BLOCK
    last_query, last_key = torch.clamp(row + BLOCK, max=length) - 1, torch.clamp(col + BLOCK, max=keys) - 1
    inside = (row + BLOCK <= length) & (col + BLOCK <= keys)
    full = inside & (row >= last_key)
    states = torch.stack(((last_query >= col) & ~full, full)).view(2, 1, 1, rows, cols)
    return _block_lists(states)


def _block_lists(states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A BlockMask's tensors from its block states ([2, batch, heads, rows, cols]: partial, full): per row of
    blocks the count and columns of partial blocks, then of full ones; then the same per column."""
    kv_num, kv_idx = _ordered(states)
    q_num, q_idx = _ordered(states.transpose(-2, -1))
    return kv_num[0], kv_idx[0], kv_num[1], kv_idx[1], q_num[0], q_idx[0], q_num[1], q_idx[1]


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `blocks`, the count of listed blocks and their column numbers, listed ones first."""
    num = blocks.sum(-1, dtype=torch.int32)
    idx = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx.contiguous()


def masked_flex_attention(query, key, value, mask, blocks, scale: float):
    """SDPA(query, key, value, attn_mask=mask, scale=scale) computed by FlexAttention over the
    BlockMask `blocks` (mask_blocks'): the call the rewritten graph makes, which AOTAutograd traces
    into the flex_attention op and its backward."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

    # Broadcast dims as stride-0 views: the functions index the mask by (b, h, q_idx, kv_idx).
    mask = _four_dims(mask).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    boolean = mask.dtype == torch.bool
    block_mask = _block_mask(blocks, _keep if boolean else _keep_all, query, key)
    options = _kernel_options(query, key, value)
    score_mod = _identity if boolean else _add_mask
    score_buffers, mask_buffers = ((), (mask,)) if boolean else ((mask,), ())
    out = flex_hop(query, key, value, score_mod, block_mask.as_tuple(), scale, options, score_buffers, mask_buffers)
    return out[0]


def causal_flex_attention(query, key, value, blocks, scale: float):
    """SDPA(query, key, value, is_causal=True, scale=scale) computed by FlexAttention over the causal
    BlockMask `blocks` (causal_blocks'); GQA where the key has fewer heads."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

    block_mask = _block_mask(blocks, _causal, query, key)
    options = _kernel_options(query, key, value)
    out = flex_hop(query, key, value, _identity, block_mask.as_tuple(), scale, options, (), ())
    return out[0]


def _block_mask(blocks, mask_mod, query, key):
    """The BlockMask of `blocks` (mask_blocks' or causal_blocks') with its `mask_mod`."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = blocks
    block_mask = BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(BLOCK, BLOCK),
        mask_mod=mask_mod,
        seq_lengths=(query.shape[2], key.shape[2]),
        compute_q_blocks=False,
    )
    # The query-side lists, from the same block states rather than recomputed from the key side.
    block_mask.q_num_blocks, block_mask.q_indices = q_num, q_idx
    block_mask.full_q_num_blocks, block_mask.full_q_indices = full_q_num, full_q_idx
    return block_mask


def _kernel_options(query, key, value) -> dict:
    """The options dict flex_attention passes its op (a private function of torch's; where its
    signature differs, the defaults it would give)."""
    from torch.nn.attention import flex_attention as flex

    try:
        return flex._apply_kernel_options(query, key, value, False, None)
    except (AttributeError, TypeError):
        return {
            "PRESCALE_QK": False,
            "ROWS_GUARANTEED_SAFE": False,
            "BLOCKS_ARE_CONTIGUOUS": False,
            "WRITE_DQ": True,
            "OUTPUT_LOGSUMEXP": True,
            "OUTPUT_MAX": False,
        }


def _four_dims(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _keep(b, h, q_idx, kv_idx, mask):
    return mask[b, h, q_idx, kv_idx]


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _keep_all(b, h, q_idx, kv_idx):
    # (torch's noop_mask traces into a tensor constant, which ember's FlexAttention lowering refuses.)
    return torch.ones_like(q_idx, dtype=torch.bool)


def _add_mask(score, b, h, q_idx, kv_idx, mask):
    value = mask[b, h, q_idx, kv_idx]
    return score + torch.where(value == float("-inf"), value, torch.clamp(value, min=MASK_FLOOR))


def _identity(score, b, h, q_idx, kv_idx, *buffers):
    return score
