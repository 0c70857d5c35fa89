"""The attention matcher: attention written out by hand in Dynamo's Torch-level FX graph, found
where `F.scaled_dot_product_attention` computes the same function (patterns.py rewrites it).

The matcher starts at each matrix product `P @ v` and walks up:

    P      := dropout(P, p=0 or not training) | cast(P) | softmax(S, dim=-1)
    S      := cast(S) | S * c | c * S | S / c | S + mask | mask + S
            | S.masked_fill(cond, -inf) | torch.where(keep, S, -inf) | q' @ k'
    q', k' := q * c | q / c | q                 (k' may be k.transpose(-2, -1), k.mT, ...)

`c` are Python numbers (after Dynamo, `math.sqrt(d)` and `d ** -0.5` of a static size are
constants); their product, exact in double precision, is the `scale` SDPA gets. A match is
rewritten only when SDPA computes the same function:

* q, k, v: one floating dtype, one device, 3-D or 4-D with equal batch dims (no broadcasting);
  softmax over the last dim; every intermediate node has exactly one user (the score matrix
  is not returned or reused) and no in-place op runs between the first matmul and the last.
* Scale factors are finite and positive (so a -inf fill stays -inf wherever it sits); an
  additive mask sits above every scale factor (SDPA adds the mask after scaling), has q's dtype
  and needs no gradient. At most one mask.
* Masks: a fill must be exactly -inf (a finite fill such as `finfo.min` gives a fully masked
  row a uniform distribution where SDPA gives zeros, so it is left alone). A mask built only
  from constants (`torch.tril(torch.ones(L, L))`, sliced, viewed, compared) is evaluated at
  compile time (constant_masks.py); if it is the lower triangle of a square score matrix the call becomes `is_causal=True`,
  otherwise the boolean mask itself is passed.
* Casts: only to q's dtype or to float32. Dropping an fp32 upcast around softmax is exact in
  spirit because every SDPA backend keeps scores and softmax in fp32 for bf16/fp16 inputs
  (flash, memory-efficient and cuDNN accumulate in fp32; the CPU flash kernel accumulates in
  fp32; the math fallback upcasts half types to fp32). Without a cast, eager rounds the scores
  to bf16 before softmax; SDPA does not, so it is at least as accurate.
* Dropout: only an identity dropout (p == 0, or training=False, e.g. `model.eval()`) is
  dropped. A live dropout is left alone: SDPA's dropout draws a different random stream, so
  the result would not be the one eager computes.

Known difference: a row that a boolean mask removes entirely gives NaN in the written form
and zeros in SDPA. Causal masks never remove a whole row.

3-D inputs ([B·H, L, E]) go through SDPA as [1, B·H, L, E]: the fused kernels want 4-D.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from ember.frontend.constant_masks import evaluated, keeps, square
from ember.frontend.fx_nodes import call_arg, example_value, is_call, mutates

_MATMUL_FUNCS = {operator.matmul, torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.bmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_MUL_FUNCS = {operator.mul, torch.mul, torch.multiply, torch.Tensor.mul}
_MUL_METHODS = {"mul", "multiply", "__mul__", "__rmul__"}
_DIV_FUNCS = {operator.truediv, torch.div, torch.true_divide, torch.divide, torch.Tensor.div}
_DIV_METHODS = {"div", "divide", "true_divide", "__truediv__"}
_ADD_FUNCS = {operator.add, torch.add, torch.Tensor.add}
_ADD_METHODS = {"add", "__add__", "__radd__"}
_SOFTMAX_FUNCS = {torch.softmax, F.softmax, torch.special.softmax, torch.Tensor.softmax}
_DROPOUT_FUNCS = {F.dropout, torch.dropout}
_CAST_METHODS = {"to", "float", "half", "bfloat16", "double", "type", "type_as"}
_TRANSPOSE_FUNCS = {torch.transpose, torch.swapaxes, torch.swapdims, torch.Tensor.transpose}
_TRANSPOSE_METHODS = {"transpose", "swapaxes", "swapdims"}
_WHERE_FUNCS = {torch.where}
_MASKED_FILL_FUNCS = {torch.masked_fill, torch.Tensor.masked_fill}
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class Rewrite:
    """One attention match, rewritten (or, before `apply`, about to be)."""

    out: fx.Node  # the `P @ v` node that SDPA replaces
    q: fx.Node
    k: fx.Node | None  # None: k is `k_t` transposed back
    k_t: fx.Node | None
    v: fx.Node
    scale: float
    mask: str = "none"  # none | causal | bool | additive
    mask_node: fx.Node | None = None  # additive mask, or the boolean *keep* mask
    invert_mask: bool = False  # mask_node is a "drop" condition (masked_fill): pass ~mask_node
    dropped: list[str] = field(default_factory=list)  # what the written form had that SDPA absorbs
    chain: list[fx.Node] = field(default_factory=list)  # single-use nodes from the score matmul to `out`
    peeled: list[fx.Node] = field(default_factory=list)  # scales/transpose taken off q and k (may have other users)
    ndim: int = 4

    def describe(self) -> str:
        what = ", ".join(self.dropped)
        return f"{self.out.name}: softmax(q@k^T * {self.scale:.6g}, mask={self.mask}) @ v [{what}] -> SDPA"


def find_attention(gm: fx.GraphModule) -> list[Rewrite]:
    """The attention matches in `gm`, without changing it."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    mutations = [order[n] for n in graph.nodes if mutates(n)]
    found = []
    claimed: set[fx.Node] = set()
    for node in list(graph.nodes):
        match = _match(node, order, mutations)
        if match is not None and not claimed.intersection(match.chain):
            claimed.update(match.chain)
            found.append(match)
    return found


# ---------------------------------------------------------------------------------------------
# Recognising nodes


def _number(x: Any) -> float | None:
    """A Python constant usable as a scale factor: finite and positive."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) and x > 0 else None


def _scale_factor(node: fx.Node) -> tuple[fx.Node, float] | None:
    """`x * c`, `c * x` or `x / c` with a positive constant c: (x, factor)."""
    if node.kwargs:
        return None
    if is_call(node, _MUL_FUNCS, _MUL_METHODS) and len(node.args) == 2:
        a, b = node.args
        if isinstance(a, fx.Node) and _number(b) is not None:
            return a, _number(b)
        if isinstance(b, fx.Node) and _number(a) is not None:
            return b, _number(a)
    if is_call(node, _DIV_FUNCS, _DIV_METHODS) and len(node.args) == 2:
        a, b = node.args
        if isinstance(a, fx.Node) and _number(b) is not None:
            return a, 1.0 / _number(b)
    return None


def _same_shape(a, b) -> bool:
    if len(a) != len(b):
        return False
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    for x, y in zip(a, b, strict=True):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif not statically_known_true(x == y):
            return False
    return True


def _is_cast(node: fx.Node, allowed: tuple) -> bool:
    """A pure dtype conversion (same shape and device) to one of `allowed`."""
    if not is_call(node, {torch.Tensor.to}, _CAST_METHODS) or not node.args:
        return False
    src, out = example_value(node.args[0]), example_value(node)
    return (
        src is not None
        and out is not None
        and out.dtype in allowed
        and out.device == src.device
        and _same_shape(out.shape, src.shape)
    )


def _is_identity_dropout(node: fx.Node) -> bool:
    if not is_call(node, _DROPOUT_FUNCS, set()):
        return False
    if node.target is torch.dropout:
        p, training = call_arg(node, 1, "p", None), call_arg(node, 2, "train", None)
    else:
        p, training = call_arg(node, 1, "p", 0.5), call_arg(node, 2, "training", True)
    return isinstance(p, (int, float)) and isinstance(training, bool) and (p == 0 or not training)


def _transposed_last(node: fx.Node, ndim: int) -> fx.Node | None:
    """x if node is x with its last two dims swapped (x.transpose(-2, -1), x.mT, permute), else None."""
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("mT",):
        return node.args[0]
    last = {ndim - 2, ndim - 1}
    if is_call(node, _TRANSPOSE_FUNCS, _TRANSPOSE_METHODS) and len(node.args) == 3 and not node.kwargs:
        dims = node.args[1:]
        if all(isinstance(d, int) for d in dims) and {d % ndim for d in dims} == last:
            return node.args[0]
    if is_call(node, {torch.permute, torch.Tensor.permute}, {"permute"}) and not node.kwargs:
        dims = node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        want = tuple(range(ndim - 2)) + (ndim - 1, ndim - 2)
        if all(isinstance(d, int) for d in dims) and tuple(d % ndim for d in dims) == want:
            return node.args[0]
    return None


# ---------------------------------------------------------------------------------------------
# Matching


class _NoMatch(Exception):
    pass


def _require(cond: bool) -> None:
    if not cond:
        raise _NoMatch


def _match(out: fx.Node, order: dict, mutations: list[int]) -> Rewrite | None:
    if not is_call(out, _MATMUL_FUNCS, _MATMUL_METHODS) or len(out.args) != 2 or out.kwargs:
        return None
    try:
        return _match_attention(out, order, mutations)
    except _NoMatch:
        return None


def _input(node: fx.Node) -> Any:
    """The tensor a one-input op reads (`F.softmax(input=x)` passes it by keyword)."""
    return node.args[0] if node.args else node.kwargs.get("input")


def _single_use(node: Any) -> fx.Node:
    _require(isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and len(node.users) == 1)
    return node


def _match_attention(out: fx.Node, order: dict, mutations: list[int]) -> Rewrite:
    """The attention that ends at `out` (`P @ v`), walked up in steps: to the softmax, to the score
    matmul, then its operands. Raises _NoMatch wherever SDPA would not compute the same function."""
    p, v = out.args
    vv, ov = example_value(v), example_value(out)
    _require(vv is not None and ov is not None and vv.dim() in (3, 4) and vv.is_floating_point())
    rw = Rewrite(out=out, q=None, k=None, k_t=None, v=v, scale=1.0, chain=[out], ndim=vv.dim())  # type: ignore[arg-type]
    casts = (vv.dtype, torch.float32) if vv.dtype in (*_LOW_PRECISION, torch.float32) else (vv.dtype,)
    softmax = _walk_to_softmax(p, rw, vv.dtype, casts)
    scores = _walk_to_scores(softmax, rw, vv, casts)
    _take_operands(scores, rw, vv, ov)

    # No in-place op between the first product and the last: SDPA reads q, k, v at `out`.
    first = min(order[n] for n in rw.chain)
    _require(not any(first < i < order[out] for i in mutations))

    if rw.mask != "none" and _is_causal(rw, example_value(scores).shape):
        rw.mask = "causal"
    return rw


def _walk_to_softmax(p: Any, rw: Rewrite, dtype: torch.dtype, casts: tuple) -> fx.Node:
    """From P up to the softmax that makes it, through identity dropouts and casts (SDPA absorbs
    both); the softmax must be over the last dim."""
    node = _single_use(p)
    _require(example_value(node) is not None and example_value(node).dtype == dtype)
    while not is_call(node, _SOFTMAX_FUNCS, {"softmax"}):
        if _is_identity_dropout(node):
            rw.dropped.append("identity dropout")
        elif _is_cast(node, casts):
            _note_cast(node, rw)
        else:
            raise _NoMatch
        rw.chain.append(node)
        node = _single_use(_input(node))
    rw.chain.append(node)
    dim = call_arg(node, 1, "dim", None)
    _require(isinstance(dim, int) and dim % rw.ndim == rw.ndim - 1 and example_value(node) is not None)
    _require(example_value(node).dtype in casts)
    return node


def _walk_to_scores(softmax: fx.Node, rw: Rewrite, vv, casts: tuple) -> fx.Node:
    """From the softmax's input up to the score matmul, through casts, constant scale factors (their
    product accumulates in rw.scale) and at most one mask."""
    seen_scale = False
    node = _single_use(_input(softmax))
    while not is_call(node, _MATMUL_FUNCS, _MATMUL_METHODS):
        rw.chain.append(node)
        sv = example_value(node)
        _require(sv is not None and sv.dtype in casts)
        step = _scale_factor(node)
        if step is not None:
            node, factor = step
            rw.scale *= factor
            seen_scale = True
        elif _is_cast(node, casts):
            _note_cast(node, rw)
            node = node.args[0]
        elif is_call(node, _ADD_FUNCS, _ADD_METHODS) and len(node.args) == 2 and not node.kwargs:
            # SDPA adds the mask to the *scaled* scores: no scale factor may sit above it.
            _require(not seen_scale)
            node = _take_additive_mask(node, rw, sv, vv)
        elif is_call(node, _MASKED_FILL_FUNCS, {"masked_fill"}) and len(node.args) == 3 and not node.kwargs:
            node = _take_masked_fill(node, rw, sv, vv)
        elif is_call(node, _WHERE_FUNCS, set()) and len(node.args) == 3 and not node.kwargs:
            node = _take_where_mask(node, rw, sv, vv)
        else:
            raise _NoMatch
        node = _single_use(node)
    rw.chain.append(node)
    _require(not node.kwargs and len(node.args) == 2)
    sv = example_value(node)
    _require(sv is not None and sv.dtype == vv.dtype)
    return node


def _note_cast(node: fx.Node, rw: Rewrite) -> None:
    """A cast the rewrite drops: said in the rewrite's description, if it changes the dtype."""
    out = example_value(node).dtype
    if example_value(node.args[0]).dtype != out:
        rw.dropped.append(f"cast to {str(out).removeprefix('torch.')}")


def _take_additive_mask(node: fx.Node, rw: Rewrite, sv, vv) -> Any:
    """`S + mask` (either order): the mask, of q's dtype, needing no gradient, goes to rw; returns S."""
    _require(rw.mask == "none")
    a, b = node.args
    scores, mask = (a, b) if _scores_like(a, sv) else (b, a)
    _require(_scores_like(scores, sv) and isinstance(mask, fx.Node))
    mv = example_value(mask)
    _require(mv is not None and mv.dtype == vv.dtype and not mv.requires_grad and mv.device == vv.device)
    _require(_broadcasts_to(mv.shape, sv.shape))
    rw.mask, rw.mask_node = "additive", mask
    return scores


def _take_masked_fill(node: fx.Node, rw: Rewrite, sv, vv) -> Any:
    """`S.masked_fill(drop, -inf)`: the boolean mask goes to rw, to be inverted; returns S."""
    _require(rw.mask == "none" and _is_neg_inf(node.args[2]))
    cond = node.args[1]
    _require(_is_bool_mask(cond, sv.shape) and example_value(cond).device == vv.device)
    rw.mask, rw.mask_node, rw.invert_mask = "bool", cond, True
    _peel_not(rw)
    return node.args[0]


def _take_where_mask(node: fx.Node, rw: Rewrite, sv, vv) -> Any:
    """`torch.where(keep, S, -inf)` or `torch.where(drop, -inf, S)`: the boolean mask goes to rw;
    returns S."""
    _require(rw.mask == "none")
    cond, a, b = node.args
    if _is_neg_inf(b):
        rw.invert_mask, scores = False, a
    else:
        _require(_is_neg_inf(a))
        rw.invert_mask, scores = True, b
    _require(_is_bool_mask(cond, sv.shape) and example_value(cond).device == vv.device and isinstance(scores, fx.Node))
    rw.mask, rw.mask_node = "bool", cond
    _peel_not(rw)
    return scores


def _take_operands(scores: fx.Node, rw: Rewrite, vv, ov) -> None:
    """q and k from the score matmul's operands, their constant scale factors and k's transpose
    peeled; one dtype and device, and shapes SDPA takes as they are (equal batch dims)."""
    q, k_t = scores.args
    q, scale = _peel_scale(q, rw.scale, rw.peeled)
    k_t, scale = _peel_scale(k_t, scale, rw.peeled)
    k = _transposed_last(k_t, rw.ndim) if isinstance(k_t, fx.Node) else None
    if k is not None:
        rw.peeled.append(k_t)
        k, scale = _peel_scale(k, scale, rw.peeled)
    dtype, ndim, sv = vv.dtype, rw.ndim, example_value(scores)
    qv, kv = example_value(q), example_value(k) if k is not None else example_value(k_t)
    _require(qv is not None and kv is not None and qv.dtype == dtype and kv.dtype == dtype)
    _require(qv.dim() == ndim and kv.dim() == ndim and qv.device == vv.device == kv.device)
    k_shape = kv.shape if k is not None else (*kv.shape[:-2], kv.shape[-1], kv.shape[-2])
    batch = qv.shape[:-2]
    _require(_same_shape(k_shape[:-2], batch) and _same_shape(vv.shape[:-2], batch))
    _require(_same_shape(qv.shape[-1:], k_shape[-1:]) and _same_shape(k_shape[-2:-1], vv.shape[-2:-1]))
    _require(_same_shape(sv.shape, (*batch, qv.shape[-2], k_shape[-2])))
    _require(_same_shape(ov.shape, (*batch, qv.shape[-2], vv.shape[-1])) and ov.dtype == dtype)
    _require(math.isfinite(scale) and scale > 0)
    rw.q, rw.k, rw.k_t, rw.scale = q, k, (None if k is not None else k_t), scale


def _peel_scale(node: Any, scale: float, peeled: list[fx.Node]) -> tuple[Any, float]:
    """Take constant scale factors off an operand of the score matmul (x * c @ ... = c * (x @ ...))."""
    while isinstance(node, fx.Node):
        step = _scale_factor(node)
        if (
            step is None
            or example_value(step[0]) is None
            or example_value(node) is None
            or example_value(step[0]).dtype != example_value(node).dtype
        ):
            break
        peeled.append(node)
        node, scale = step[0], scale * step[1]
    return node, scale


def _scores_like(node: Any, sv) -> bool:
    v = example_value(node)
    return v is not None and _same_shape(v.shape, sv.shape) and node.op in ("call_function", "call_method")


def _broadcasts_to(small, big) -> bool:
    if len(small) > len(big):
        return False
    for a, b in zip(reversed(small), reversed(big), strict=False):
        if not (isinstance(a, int) and a == 1) and not _same_shape((a,), (b,)):
            return False
    return True


def _is_bool_mask(node: Any, shape) -> bool:
    mv = example_value(node)
    return mv is not None and mv.dtype == torch.bool and not mv.requires_grad and _broadcasts_to(mv.shape, shape)


def _peel_not(rw: Rewrite) -> None:
    """masked_fill(~keep, -inf): pass `keep` itself rather than a negation of a negation."""
    cond = rw.mask_node
    if is_call(
        cond, {operator.invert, torch.logical_not, torch.bitwise_not}, {"logical_not", "bitwise_not", "__invert__"}
    ):
        inner = cond.args[0] if len(cond.args) == 1 and not cond.kwargs else None
        if _is_bool_mask(inner, example_value(cond).shape):
            rw.peeled.append(cond)
            rw.mask_node, rw.invert_mask = inner, not rw.invert_mask


def _is_neg_inf(x: Any) -> bool:
    return isinstance(x, float) and x == -math.inf


def _is_causal(rw: Rewrite, scores_shape) -> bool:
    """Whether the mask is, provably, SDPA's is_causal (lower triangle of a square score matrix)."""
    L, S = scores_shape[-2], scores_shape[-1]
    mask = evaluated(rw.mask_node)
    if mask is None or any(d != 1 for d in mask.shape[:-2]):
        return False
    if rw.mask == "additive":
        return mask.is_floating_point() and keeps(mask, -math.inf) == "causal" and square(L, S, mask.shape[-2:])
    keep = ~mask if rw.invert_mask else mask
    return mask.dtype == torch.bool and keeps(keep) == "causal" and square(L, S, mask.shape[-2:])
