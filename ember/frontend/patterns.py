"""Attention written out by hand, rewritten to `F.scaled_dot_product_attention` (the `attention` pass).

Runs on Dynamo's Torch-level FX graph, *before* AOTAutograd, so that AOTAutograd traces SDPA's
forward and its own backward (flash / cuDNN / memory-efficient on CUDA, the fused CPU kernel on
CPU) instead of two batched matmuls and a softmax with the whole score matrix in memory.

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
  from constants (`torch.tril(torch.ones(L, L))`, sliced, viewed, compared) is evaluated here;
  if it is the lower triangle of a square score matrix the call becomes `is_causal=True`,
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

from ember import config, log

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
_INPLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imatmul,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.setitem,
}
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


def attention_pass(gm: fx.GraphModule) -> list[Rewrite]:
    """The pass as the backend runs it: rewrite, log each rewrite (`EMBER_LOGS=patterns`).

    If matching fails unexpectedly the graph is left exactly as Dynamo gave it, with a warning
    (EMBER_STRICT=1 raises): the pass is an optimisation, never a reason not to compile.
    """
    try:
        found = find_attention(gm)
    except Exception as e:
        if config.get("strict"):
            raise
        log.warn(f"ember: attention pattern matching failed, graph left as written: {type(e).__name__}: {e}")
        return []
    apply(gm, found)
    if found:
        log.artifact("patterns", f"{len(found)} attention rewrite(s)", lambda: "\n".join(rw.describe() for rw in found))
    densified = dense_sdpa_masks(gm)
    if densified:
        log.artifact("patterns", f"{len(densified)} SDPA mask(s) made dense", lambda: "\n".join(densified))
    return found


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
        mask = _arg(node, 3, "attn_mask")
        q, m = _val(node.args[0]) if node.args else None, _val(mask)
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


def find_attention(gm: fx.GraphModule) -> list[Rewrite]:
    """The attention matches in `gm`, without changing it."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    mutations = [order[n] for n in graph.nodes if _mutates(n)]
    found = []
    claimed: set[fx.Node] = set()
    for node in list(graph.nodes):
        match = _match(node, order, mutations)
        if match is not None and not claimed.intersection(match.chain):
            claimed.update(match.chain)
            found.append(match)
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
# Recognising nodes


def _is(node: Any, funcs: set, methods: set) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in funcs
    return node.op == "call_method" and node.target in methods


def _val(node: Any):
    """The FakeTensor Dynamo recorded for `node`, or None."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value")
    return v if isinstance(v, torch.Tensor) else None


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    # A method's args[0] is self, so `x.softmax(dim)` and `F.softmax(x, dim)` index alike.
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


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
    if _is(node, _MUL_FUNCS, _MUL_METHODS) and len(node.args) == 2:
        a, b = node.args
        if isinstance(a, fx.Node) and _number(b) is not None:
            return a, _number(b)
        if isinstance(b, fx.Node) and _number(a) is not None:
            return b, _number(a)
    if _is(node, _DIV_FUNCS, _DIV_METHODS) and len(node.args) == 2:
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
    if not _is(node, {torch.Tensor.to}, _CAST_METHODS) or not node.args:
        return False
    src, out = _val(node.args[0]), _val(node)
    return (
        src is not None
        and out is not None
        and out.dtype in allowed
        and out.device == src.device
        and _same_shape(out.shape, src.shape)
    )


def _is_identity_dropout(node: fx.Node) -> bool:
    if not _is(node, _DROPOUT_FUNCS, set()):
        return False
    if node.target is torch.dropout:
        p, training = _arg(node, 1, "p", None), _arg(node, 2, "train", None)
    else:
        p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
    return isinstance(p, (int, float)) and isinstance(training, bool) and (p == 0 or not training)


def _transposed_last(node: fx.Node, ndim: int) -> fx.Node | None:
    """x if node is x with its last two dims swapped (x.transpose(-2, -1), x.mT, permute), else None."""
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("mT",):
        return node.args[0]
    last = {ndim - 2, ndim - 1}
    if _is(node, _TRANSPOSE_FUNCS, _TRANSPOSE_METHODS) and len(node.args) == 3 and not node.kwargs:
        dims = node.args[1:]
        if all(isinstance(d, int) for d in dims) and {d % ndim for d in dims} == last:
            return node.args[0]
    if _is(node, {torch.permute, torch.Tensor.permute}, {"permute"}) and not node.kwargs:
        dims = node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        want = tuple(range(ndim - 2)) + (ndim - 1, ndim - 2)
        if all(isinstance(d, int) for d in dims) and tuple(d % ndim for d in dims) == want:
            return node.args[0]
    return None


def _mutates(node: fx.Node) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


# ---------------------------------------------------------------------------------------------
# Matching


class _NoMatch(Exception):
    pass


def _require(cond: bool) -> None:
    if not cond:
        raise _NoMatch


def _match(out: fx.Node, order: dict, mutations: list[int]) -> Rewrite | None:
    if not _is(out, _MATMUL_FUNCS, _MATMUL_METHODS) or len(out.args) != 2 or out.kwargs:
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
    p, v = out.args
    vv, ov = _val(v), _val(out)
    _require(vv is not None and ov is not None and vv.dim() in (3, 4) and vv.is_floating_point())
    dtype, ndim = vv.dtype, vv.dim()
    casts = (dtype, torch.float32) if dtype in (*_LOW_PRECISION, torch.float32) else (dtype,)
    dropped: list[str] = []
    chain = [out]

    # Above softmax: identity dropouts and casts, down to softmax.
    node = _single_use(p)
    _require(_val(node) is not None and _val(node).dtype == dtype)
    while not _is(node, _SOFTMAX_FUNCS, {"softmax"}):
        if _is_identity_dropout(node):
            dropped.append("identity dropout")
        elif _is_cast(node, casts):
            if _val(node.args[0]).dtype != _val(node).dtype:
                dropped.append(f"cast to {str(_val(node).dtype).removeprefix('torch.')}")
        else:
            raise _NoMatch
        chain.append(node)
        node = _single_use(_input(node))
    softmax = node
    chain.append(softmax)
    dim = _arg(softmax, 1, "dim", None)
    _require(isinstance(dim, int) and dim % ndim == ndim - 1 and _val(softmax) is not None)
    _require(_val(softmax).dtype in casts)

    # Between softmax and the score matmul: casts, scale factors, one mask.
    scale = 1.0
    rw = Rewrite(out=out, q=None, k=None, k_t=None, v=v, scale=1.0, dropped=dropped, chain=chain, ndim=ndim)  # type: ignore[arg-type]
    seen_scale = False
    node = _single_use(_input(softmax))
    while not _is(node, _MATMUL_FUNCS, _MATMUL_METHODS):
        chain.append(node)
        sv = _val(node)
        _require(sv is not None and sv.dtype in casts)
        step = _scale_factor(node)
        if step is not None:
            node, factor = step
            scale *= factor
            seen_scale = True
        elif _is_cast(node, casts):
            if _val(node.args[0]).dtype != sv.dtype:
                dropped.append(f"cast to {str(sv.dtype).removeprefix('torch.')}")
            node = node.args[0]
        elif _is(node, _ADD_FUNCS, _ADD_METHODS) and len(node.args) == 2 and not node.kwargs:
            # SDPA adds the mask to the *scaled* scores: no scale factor may sit above it.
            _require(rw.mask == "none" and not seen_scale)
            a, b = node.args
            scores, mask = (a, b) if _scores_like(a, sv) else (b, a)
            _require(_scores_like(scores, sv) and isinstance(mask, fx.Node))
            mv = _val(mask)
            _require(mv is not None and mv.dtype == dtype and not mv.requires_grad and mv.device == vv.device)
            _require(_broadcasts_to(mv.shape, sv.shape))
            rw.mask, rw.mask_node = "additive", mask
            node = scores
        elif _is(node, _MASKED_FILL_FUNCS, {"masked_fill"}) and len(node.args) == 3 and not node.kwargs:
            _require(rw.mask == "none" and _is_neg_inf(node.args[2]))
            cond = node.args[1]
            _require(_is_bool_mask(cond, sv.shape) and _val(cond).device == vv.device)
            rw.mask, rw.mask_node, rw.invert_mask = "bool", cond, True
            _peel_not(rw)
            node = node.args[0]
        elif _is(node, _WHERE_FUNCS, set()) and len(node.args) == 3 and not node.kwargs:
            _require(rw.mask == "none")
            cond, a, b = node.args
            if _is_neg_inf(b):
                rw.invert_mask, node = False, a
            else:
                _require(_is_neg_inf(a))
                rw.invert_mask, node = True, b
            _require(_is_bool_mask(cond, sv.shape) and _val(cond).device == vv.device and isinstance(node, fx.Node))
            rw.mask, rw.mask_node = "bool", cond
            _peel_not(rw)
        else:
            raise _NoMatch
        node = _single_use(node)
    scores = node
    chain.append(scores)
    _require(not scores.kwargs and len(scores.args) == 2)
    sv = _val(scores)
    _require(sv is not None and sv.dtype == dtype)

    # The operands of the score matmul: peel scale factors and the transpose of k.
    q, k_t = scores.args
    q, scale = _peel_scale(q, scale, rw.peeled)
    k_t, scale = _peel_scale(k_t, scale, rw.peeled)
    k = _transposed_last(k_t, ndim) if isinstance(k_t, fx.Node) else None
    if k is not None:
        rw.peeled.append(k_t)
        k, scale = _peel_scale(k, scale, rw.peeled)
    qv, kv = _val(q), _val(k) if k is not None else _val(k_t)
    _require(qv is not None and kv is not None and qv.dtype == dtype and kv.dtype == dtype)
    _require(qv.dim() == ndim and kv.dim() == ndim and qv.device == vv.device == kv.device)
    k_shape = kv.shape if k is not None else (*kv.shape[:-2], kv.shape[-1], kv.shape[-2])
    batch = qv.shape[:-2]
    _require(_same_shape(k_shape[:-2], batch) and _same_shape(vv.shape[:-2], batch))
    _require(_same_shape(qv.shape[-1:], k_shape[-1:]) and _same_shape(k_shape[-2:-1], vv.shape[-2:-1]))
    _require(_same_shape(sv.shape, (*batch, qv.shape[-2], k_shape[-2])))
    _require(_same_shape(ov.shape, (*batch, qv.shape[-2], vv.shape[-1])) and ov.dtype == dtype)
    _require(math.isfinite(scale) and scale > 0)

    # No in-place op between the first product and the last: SDPA reads q, k, v at `out`.
    first = min(order[n] for n in chain)
    _require(not any(first < i < order[out] for i in mutations))

    rw.q, rw.k, rw.k_t, rw.scale = q, k, (None if k is not None else k_t), scale
    if rw.mask != "none" and _is_causal(rw, sv.shape):
        rw.mask = "causal"
    return rw


def _peel_scale(node: Any, scale: float, peeled: list[fx.Node]) -> tuple[Any, float]:
    """Take constant scale factors off an operand of the score matmul (x * c @ ... = c * (x @ ...))."""
    while isinstance(node, fx.Node):
        step = _scale_factor(node)
        if step is None or _val(step[0]) is None or _val(node) is None or _val(step[0]).dtype != _val(node).dtype:
            break
        peeled.append(node)
        node, scale = step[0], scale * step[1]
    return node, scale


def _scores_like(node: Any, sv) -> bool:
    v = _val(node)
    return v is not None and _same_shape(v.shape, sv.shape) and node.op in ("call_function", "call_method")


def _broadcasts_to(small, big) -> bool:
    if len(small) > len(big):
        return False
    for a, b in zip(reversed(small), reversed(big), strict=False):
        if not (isinstance(a, int) and a == 1) and not _same_shape((a,), (b,)):
            return False
    return True


def _is_bool_mask(node: Any, shape) -> bool:
    mv = _val(node)
    return mv is not None and mv.dtype == torch.bool and not mv.requires_grad and _broadcasts_to(mv.shape, shape)


def _peel_not(rw: Rewrite) -> None:
    """masked_fill(~keep, -inf): pass `keep` itself rather than a negation of a negation."""
    cond = rw.mask_node
    if _is(cond, {operator.invert, torch.logical_not, torch.bitwise_not}, {"logical_not", "bitwise_not", "__invert__"}):
        inner = cond.args[0] if len(cond.args) == 1 and not cond.kwargs else None
        if _is_bool_mask(inner, _val(cond).shape):
            rw.peeled.append(cond)
            rw.mask_node, rw.invert_mask = inner, not rw.invert_mask


def _is_neg_inf(x: Any) -> bool:
    return isinstance(x, float) and x == -math.inf


# ---------------------------------------------------------------------------------------------
# Causal masks built from constants


# Ops a mask may be built from to be evaluated here: factories and shape/compare ops only.
_CONST_FUNCS = {
    torch.ones,
    torch.zeros,
    torch.full,
    torch.arange,
    torch.tril,
    torch.triu,
    torch.logical_not,
    torch.where,
    torch.masked_fill,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.invert,
    operator.getitem,
    operator.sub,
    operator.add,
    operator.neg,
}
_CONST_METHODS = {
    "tril",
    "triu",
    "bool",
    "float",
    "to",
    "view",
    "reshape",
    "unsqueeze",
    "expand",
    "logical_not",
    "masked_fill",
    "__getitem__",
    "eq",
    "ne",
}
_MAX_CONST_ELEMENTS = 1 << 24


def _constant(node: fx.Node, memo: dict) -> Any:
    """Evaluate `node` on the CPU if it is built from constants only; raises _NoMatch otherwise."""
    if node in memo:
        return memo[node]
    _require(_is(node, _CONST_FUNCS, _CONST_METHODS))

    def value(a):
        if isinstance(a, fx.Node):
            return _constant(a, memo)
        if isinstance(a, (tuple, list)):
            return type(a)(value(x) for x in a)
        if isinstance(a, slice):
            return slice(value(a.start), value(a.stop), value(a.step))
        _require(a is None or isinstance(a, (int, float, bool, torch.dtype, torch.device, str, type(...))))
        return a

    args = value(node.args)
    kwargs = {k: (torch.device("cpu") if k == "device" else value(a)) for k, a in node.kwargs.items()}
    if node.op == "call_method":
        self, *rest = args
        if node.target == "to":
            rest = [a for a in rest if not isinstance(a, (torch.device, str))]
        result = getattr(self, node.target)(*rest, **kwargs)
    else:
        result = node.target(*args, **kwargs)
    _require(not isinstance(result, torch.Tensor) or result.numel() <= _MAX_CONST_ELEMENTS)
    memo[node] = result
    return result


def _is_causal(rw: Rewrite, scores_shape) -> bool:
    """Whether the mask is, provably, SDPA's is_causal (lower triangle of a square score matrix)."""
    L, S = scores_shape[-2], scores_shape[-1]
    if not (isinstance(L, int) and isinstance(S, int) and L == S):
        return False  # is_causal aligns top-left; only claim it where that cannot matter
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily():
            mask = _constant(rw.mask_node, {})
            if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or tuple(mask.shape[-2:]) != (L, S):
                return False
            if any(d != 1 for d in mask.shape[:-2]):
                return False
            mask = mask.reshape(L, S)
            tril = torch.ones(L, S, dtype=torch.bool).tril()
            if rw.mask == "additive":
                causal = torch.zeros(L, S, dtype=mask.dtype).masked_fill(~tril, -math.inf)
                return bool(torch.equal(mask, causal))
            keep = ~mask if rw.invert_mask else mask
            return mask.dtype == torch.bool and bool(torch.equal(keep, tril))
    except _NoMatch:
        return False
    except (RuntimeError, TypeError, ValueError, IndexError):  # not evaluable here: not known to be causal
        return False


# ---------------------------------------------------------------------------------------------
# Rewriting


def _apply(graph: fx.Graph, rw: Rewrite) -> fx.Node:
    out = rw.out
    with graph.inserting_before(out):
        # The fused kernels want the last dim contiguous; a transposed view would send SDPA to
        # its math fallback.
        q, v = _contiguous_last(graph, rw.q, _val(rw.q)), _contiguous_last(graph, rw.v, _val(rw.v))
        if rw.k is not None:
            k = _contiguous_last(graph, rw.k, _val(rw.k))
        else:  # q @ k_t with k_t not a transpose: SDPA gets k_t.transpose(-2, -1)
            k = graph.call_method("transpose", (rw.k_t, -2, -1))
            k_t = _val(rw.k_t)
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
        dead += _ancestors(rw.mask_node)
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(dead), key=lambda n: -position[n]):
        if not node.users and node.op in ("call_function", "call_method") and not _mutates(node):
            graph.erase_node(node)
    return new


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, todo = [], [node]
    while todo:
        n = todo.pop()
        if n not in seen and _is(n, _CONST_FUNCS, _CONST_METHODS):
            seen.append(n)
            todo.extend(n.all_input_nodes)
    return seen


_VIEW_METHODS = {"transpose", "permute", "squeeze", "unsqueeze", "expand", "__getitem__", "swapaxes", "swapdims"}
_VIEW_FUNCS = {operator.getitem, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze, getattr}


def _layout_read(node: fx.Node) -> bool:
    """Whether `node`'s strides matter downstream: a `.view` through views of it, or the graph output."""
    for user in node.users:
        if user.op == "output" or _is(user, {torch.Tensor.view}, {"view"}):
            return True
        if _is(user, _VIEW_FUNCS, _VIEW_METHODS) and _layout_read(user):
            return True
    return False


def _contiguous_last(graph: fx.Graph, node: fx.Node, value) -> fx.Node:
    if value is not None and value.dim() and value.shape[-1] != 1 and value.stride(-1) != 1:
        return graph.call_method("contiguous", (node,))
    return node
