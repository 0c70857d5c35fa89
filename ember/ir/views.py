"""View ops as index maps.

A view never copies: reading view V at index `i` reads its base at `index_map(i)`. Chains of
views compose by composing these maps, so permute/expand/reshape/slice/select/unsqueeze all
end up as index arithmetic inside the kernel that reads them (tinygrad's and Inductor's
approach). Each view kind is one entry: its output shape and its index map.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy

from ember.ir.sizes import Expr, IndexDiv, IndexMod, affine_split, contiguous_strides, divides, product

Index = list[Expr]


@dataclass(frozen=True)
class ViewKind:
    shape: Callable[[tuple, dict], tuple]  # (input shape, attrs) -> output shape
    index: Callable[[Index, tuple, tuple, dict], Index]  # (out index, in shape, out shape, attrs) -> in index


def _permute_shape(s, a):
    return tuple(s[d] for d in a["dims"])


def _permute_index(i, s_in, s_out, a):
    result: list = [None] * len(s_in)
    for out_pos, in_dim in enumerate(a["dims"]):
        result[in_dim] = i[out_pos]
    return result


def _expand_index(i, s_in, s_out, a):
    lead = len(s_out) - len(s_in)
    return [sympy.Integer(0) if (s_in[k] == 1 and s_out[k + lead] != 1) else i[k + lead] for k in range(len(s_in))]


def _reshape_index(i, s_in, s_out, a):
    """Split both shapes into groups of equal size; index math stays inside each group.

    [2, 16, 64] -> [32, 64] maps the first input pair from one output dim (div/mod) and the
    last dim straight through, instead of flattening everything.
    """
    if any(d == 0 for d in (*s_in, *s_out)):
        # No element to address (and grouping would divide by the zero size): any index will do.
        return [sympy.Integer(0)] * len(s_in)
    result: list = []
    k_in = k_out = 0
    while k_in < len(s_in) or k_out < len(s_out):
        g_in, g_out = [k_in], [k_out]
        p_in = s_in[k_in] if k_in < len(s_in) else sympy.Integer(1)
        p_out = s_out[k_out] if k_out < len(s_out) else sympy.Integer(1)
        k_in, k_out = k_in + 1, k_out + 1
        while sympy.expand(p_in - p_out) != 0:
            if k_in >= len(s_in) and k_out >= len(s_out):
                return _flat_reshape_index(i, s_in, s_out)
            grow_in = k_out >= len(s_out) or (k_in < len(s_in) and _smaller(p_in, p_out))
            if grow_in:
                g_in.append(k_in)
                p_in = p_in * s_in[k_in]
                k_in += 1
            else:
                g_out.append(k_out)
                p_out = p_out * s_out[k_out]
                k_out += 1
        g_in = [d for d in g_in if d < len(s_in)]
        g_out = [d for d in g_out if d < len(s_out)]
        sub_out = [s_out[d] for d in g_out]
        sub_in = [s_in[d] for d in g_in]
        result += _flat_reshape_index([i[d] for d in g_out], sub_in, sub_out)
    return result


def _smaller(a: Expr, b: Expr) -> bool:
    """a < b for sizes; symbolic sizes compare by their value at a large hint."""
    diff = sympy.expand(b - a)
    if diff.is_number:
        return diff > 0
    return diff.subs({s: 1024 for s in diff.free_symbols}) > 0


def _flat_reshape_index(i, s_in, s_out):
    linear = sum((x * st for x, st in zip(i, contiguous_strides(s_out))), sympy.Integer(0))
    out = []
    for k, (size, stride) in enumerate(zip(s_in, contiguous_strides(s_in))):
        q = IndexDiv(linear, stride)
        out.append(q if k == 0 else IndexMod(q, size))
    return out


def _slice_shape(s, a):
    d, start, end, step = a["dim"], a["start"], a["end"], a["step"]
    length = IndexDiv(end - start + step - 1, step) if step != 1 else end - start
    return s[:d] + (length,) + s[d + 1 :]


def _slice_index(i, s_in, s_out, a):
    d = a["dim"]
    return i[:d] + [a["start"] + i[d] * a["step"]] + i[d + 1 :]


def _select_shape(s, a):
    return s[: a["dim"]] + s[a["dim"] + 1 :]


def _select_index(i, s_in, s_out, a):
    d = a["dim"]
    return i[:d] + [a["index"]] + i[d:]


def _unsqueeze_shape(s, a):
    return s[: a["dim"]] + (sympy.Integer(1),) + s[a["dim"] :]


def _unsqueeze_index(i, s_in, s_out, a):
    return i[: a["dim"]] + i[a["dim"] + 1 :]


def _squeeze_shape(s, a):
    return tuple(x for k, x in enumerate(s) if k not in a["dims"])


def _squeeze_index(i, s_in, s_out, a):
    it = iter(i)
    return [sympy.Integer(0) if k in a["dims"] else next(it) for k in range(len(s_in))]


def _replicate_pad_shape(s, a):
    return s[: a["dim"]] + (a["length"],) + s[a["dim"] + 1 :]


def _replicate_pad_index(i, s_in, s_out, a):
    """Position p along dim reads the base at p - before, clamped into [0, size).

    Contract: a reader uses the view only where p - before lies inside the base (`cat`,
    `constant_pad_nd` and max pooling put a `where` over the position); outside, its values are
    unspecified. Both code generators drop the clamps and load only where the position lies in
    the base (codegen/render.py, `unclamped`: a load mask in Triton, a conditional load in C++),
    which keeps the index affine and the loads vectorized."""
    d = a["dim"]
    size = s_in[d]
    shifted = i[d] - a["before"]
    if not _provably_nonnegative(-a["before"]):  # positions before the base's start
        shifted = sympy.Max(shifted, 0)
    if not _provably_nonnegative(size + a["before"] - a["length"]):  # positions after its end
        shifted = sympy.Min(shifted, size - 1)
    return i[:d] + [shifted] + i[d + 1 :]


def _chunks_shape(s, a):
    return s[: a["dim"]] + (sympy.Integer(a["count"]), sympy.Integer(a["length"])) + s[a["dim"] + 1 :]


def _chunks_index(i, s_in, s_out, a):
    """Element j of chunk k reads the base at k * length + j, but the last chunk ends at the base's
    end: `count` chunks of `length` cover a size that `length` does not divide, the last overlapping
    the one before by count * length - size elements (a reader that must not see them twice masks
    them out: schedule/split.py). The index stays affine along j, with no clamp to vectorize around."""
    d, count, length = a["dim"], a["count"], a["length"]
    overlap = count * length - s_in[d]
    chunk, j = i[d], i[d + 1]
    return i[:d] + [chunk * length + j - overlap * IndexDiv(chunk, count - 1)] + i[d + 2 :]


def _provably_nonnegative(e: Expr) -> bool:
    e = sympy.expand(sympy.sympify(e))
    if e.is_number:
        return bool(e >= 0)
    return bool(e.is_nonnegative)


VIEW_KINDS: dict[str, ViewKind] = {
    "permute": ViewKind(_permute_shape, _permute_index),
    "expand": ViewKind(lambda s, a: tuple(a["shape"]), _expand_index),
    "reshape": ViewKind(lambda s, a: tuple(a["shape"]), _reshape_index),
    "slice": ViewKind(_slice_shape, _slice_index),
    "select": ViewKind(_select_shape, _select_index),
    "unsqueeze": ViewKind(_unsqueeze_shape, _unsqueeze_index),
    "squeeze": ViewKind(_squeeze_shape, _squeeze_index),
    # attrs dim, before (the base's offset in the view), length (the view's size along dim).
    "replicate_pad": ViewKind(_replicate_pad_shape, _replicate_pad_index),
    # attrs dim, count, length: dim viewed as `count` chunks of `length`, the last ending at dim's end.
    "chunks": ViewKind(_chunks_shape, _chunks_index),
}


def broadcast_index(index: Index, in_shape: tuple, out_shape: tuple) -> Index:
    """Index into a pointwise operand that broadcasts (numpy rules) to out_shape."""
    return _expand_index(index, in_shape, out_shape, {})


# -- simplification with known index ranges ------------------------------------------------


def upper_bound(expr: Expr, ranges: dict) -> Expr | None:
    """An upper bound (inclusive) of a non-negative index expression; ranges maps var -> size."""
    expr = sympy.expand(expr)
    if expr.is_Integer:
        return expr
    if expr.is_Symbol:
        return ranges[expr] - 1 if expr in ranges else None
    if isinstance(expr, IndexMod):
        return expr.args[1] - 1
    if isinstance(expr, IndexDiv):
        inner = upper_bound(expr.args[0], ranges)
        return None if inner is None else IndexDiv(inner, expr.args[1])
    if expr.is_Add:
        parts = [upper_bound(t, ranges) for t in expr.args]
        return None if any(p is None for p in parts) else sympy.Add(*parts)
    if expr.is_Mul:
        coeff, rest = expr.as_coeff_Mul()
        factors = sympy.Mul.make_args(rest)
        bounded = [f for f in factors if f in ranges or isinstance(f, (IndexDiv, IndexMod))]
        if coeff < 0 or len(bounded) != 1:
            return None
        inner = upper_bound(bounded[0], ranges)
        others = sympy.Mul(*[f for f in factors if f is not bounded[0]])
        return None if inner is None else coeff * others * inner
    return None


def provably_less(a: Expr, b: Expr, ranges: dict) -> bool:
    """Whether a < b for every value in range (sizes are non-negative integers)."""
    ub = upper_bound(a, ranges)
    if ub is None:
        return False
    gap = sympy.expand(b - ub - 1)
    if gap.is_number:
        return gap >= 0
    return all(c >= 0 for c in sympy.Poly(gap, *gap.free_symbols).coeffs()) if gap.is_polynomial() else False


def simplify_index(expr: Expr, ranges: dict) -> Expr:
    """Drop divisions and modulos that range facts make redundant (bottom-up)."""
    if not expr.args:
        return expr
    args = [simplify_index(a, ranges) for a in expr.args]
    if isinstance(expr, (IndexDiv, IndexMod)):
        a, b = args
        terms = sympy.Add.make_args(sympy.expand(a))
        multiples = [t for t in terms if divides(b, t)]
        rest = sympy.Add(*[t for t in terms if t not in multiples])
        if provably_less(rest, b, ranges):
            if isinstance(expr, IndexMod):
                return rest
            return sympy.expand(sympy.Add(*multiples) / b)
        return type(expr)(a, b)
    if expr.is_Add:
        return _recombine(sympy.Add(*args))
    return expr.func(*args)


def _recombine(expr: Expr) -> Expr:
    """c*k*IndexDiv(x, k) + c*IndexMod(x, k) -> c*x (what a merge-then-split of dims leaves)."""
    changed = True
    while changed and expr.is_Add:
        changed = False
        terms = list(expr.args)
        for t in terms:
            coeff, mod = _split_coeff(t, IndexMod)
            if mod is None:
                continue
            x, k = mod.args
            partner = coeff * k * IndexDiv(x, k)
            if any(sympy.expand(u - partner) == 0 for u in terms):
                expr = sympy.expand(expr - t - partner + coeff * x)
                changed = True
                break
    return expr


def _split_coeff(term: Expr, cls):
    factors = sympy.Mul.make_args(term)
    found = [f for f in factors if isinstance(f, cls)]
    if len(found) != 1:
        return None, None
    return sympy.Mul(*[f for f in factors if f is not found[0]]), found[0]


def strides_of(index_fn: Callable[[Index], Index], out_shape: tuple, base_strides: tuple, ranges_syms) -> tuple | None:
    """Strides and offset of a view of a strided buffer, if the view is affine; None otherwise."""
    syms = ranges_syms
    in_index = index_fn(list(syms))
    ranges = dict(zip(syms, out_shape))
    offset_expr = sum((x * s for x, s in zip(in_index, base_strides)), sympy.Integer(0))
    offset_expr = simplify_index(sympy.expand(offset_expr), ranges)
    strides = []
    for sym in syms:
        split = affine_split(offset_expr, sym)
        if split is None:
            return None
        coeff, offset_expr = split
        strides.append(coeff)
    if offset_expr.free_symbols & set(syms):
        return None
    return tuple(strides), offset_expr


__all__ = ["VIEW_KINDS", "broadcast_index", "product", "simplify_index", "strides_of"]
