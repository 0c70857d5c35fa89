"""View index maps, checked point by point against torch's own views, and index simplification."""

from __future__ import annotations

import itertools

import pytest
import sympy
import torch

from ember.ir.sizes import IndexDiv, IndexMod, index_symbol
from ember.ir.views import VIEW_KINDS, broadcast_index, simplify_index, strides_of

I = sympy.Integer


def _shape(s):
    return tuple(I(x) for x in s)


def _torch_view(kind, base, attrs, out_shape):
    if kind == "reshape":
        return base.reshape(tuple(int(s) for s in out_shape))
    if kind == "permute":
        return base.permute(attrs["dims"])
    if kind == "expand":
        return base.expand(tuple(int(s) for s in attrs["shape"]))
    if kind == "slice":
        d = attrs["dim"]
        index = [slice(None)] * base.dim()
        index[d] = slice(int(attrs["start"]), int(attrs["end"]), int(attrs["step"]))
        return base[tuple(index)]
    if kind == "select":
        return base.select(attrs["dim"], int(attrs["index"]))
    if kind == "unsqueeze":
        return base.unsqueeze(attrs["dim"])
    if kind == "squeeze":
        return base.squeeze(attrs["dims"])
    raise AssertionError(kind)


# (kind, input shape, attrs)
VIEW_TABLE = [
    ("reshape", (2, 4, 3), {"shape": (8, 3)}),
    ("reshape", (8, 3), {"shape": (2, 4, 3)}),
    ("reshape", (6, 4), {"shape": (2, 3, 4)}),
    ("reshape", (4, 6), {"shape": (6, 4)}),  # no common groups: flattened index math
    ("reshape", (2, 6), {"shape": (3, 4)}),
    ("reshape", (24,), {"shape": (2, 3, 4)}),
    ("reshape", (2, 3, 4), {"shape": (24,)}),
    ("reshape", (4, 3, 2), {"shape": (2, 12)}),
    ("reshape", (1, 8), {"shape": (8,)}),
    ("reshape", (8,), {"shape": (2, 1, 4)}),
    ("reshape", (3, 1, 4), {"shape": (12,)}),
    ("reshape", (2, 3, 4, 5), {"shape": (6, 20)}),
    ("reshape", (2, 3, 4, 5), {"shape": (2, 12, 5)}),
    ("permute", (2, 3, 4), {"dims": (2, 0, 1)}),
    ("permute", (2, 3, 4), {"dims": (1, 0, 2)}),
    ("expand", (3, 1), {"shape": (3, 4)}),
    ("expand", (1, 4), {"shape": (2, 3, 4)}),
    ("slice", (4, 10), {"dim": 1, "start": I(1), "end": I(10), "step": I(2)}),
    ("slice", (4, 10), {"dim": 0, "start": I(1), "end": I(3), "step": I(1)}),
    ("slice", (4, 10), {"dim": 1, "start": I(2), "end": I(10), "step": I(3)}),
    ("select", (3, 4, 5), {"dim": 1, "index": I(2)}),
    ("select", (3, 4, 5), {"dim": 0, "index": I(0)}),
    ("unsqueeze", (3, 4), {"dim": 1}),
    ("unsqueeze", (3, 4), {"dim": 2}),
    ("squeeze", (3, 1, 4), {"dims": (1,)}),
    ("squeeze", (1, 3, 1), {"dims": (0, 2)}),
]


@pytest.mark.parametrize("kind,in_shape,attrs", VIEW_TABLE, ids=[f"{k}-{s}-{a}" for k, s, a in VIEW_TABLE])
def test_view_index_map_matches_torch(kind, in_shape, attrs):
    view = VIEW_KINDS[kind]
    s_in = _shape(in_shape)
    attrs = {k: (_shape(v) if k == "shape" else v) for k, v in attrs.items()}
    s_out = tuple(sympy.sympify(s) for s in view.shape(s_in, attrs))
    base = torch.arange(int(torch.tensor(in_shape).prod())).reshape(in_shape)
    expected = _torch_view(kind, base, attrs, s_out)
    assert tuple(int(s) for s in s_out) == tuple(expected.shape), f"{kind}{in_shape} {attrs}: shape"
    for out_index in itertools.product(*(range(int(s)) for s in s_out)):
        in_index = view.index([I(i) for i in out_index], s_in, s_out, attrs)
        assert len(in_index) == len(s_in)
        got = base[tuple(int(i) for i in in_index)]
        assert got == expected[out_index], f"repro: VIEW_KINDS[{kind!r}] {in_shape} {attrs} at {out_index}"


def test_reshape_keeps_index_math_inside_groups():
    """[2, 16, 64] -> [32, 64]: the first output dim splits by div/mod; the last passes straight through."""
    i, j = index_symbol("i"), index_symbol("j")
    index = VIEW_KINDS["reshape"].index([i, j], _shape((2, 16, 64)), _shape((32, 64)), {"shape": _shape((32, 64))})
    assert index == [IndexDiv(i, 16), IndexMod(i, 16), j]


def test_reshape_groups_with_symbolic_sizes():
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    i, j = index_symbol("i"), index_symbol("j")
    s_in, s_out = (s0, I(16), I(64)), (s0 * 16, I(64))
    index = VIEW_KINDS["reshape"].index([i, j], s_in, s_out, {"shape": s_out})
    assert index == [IndexDiv(i, 16), IndexMod(i, 16), j]


def test_reshape_merge_then_split_simplifies_to_identity():
    """x.view(24).view(4, 6): composed index math simplifies back to the plain row-major offset."""
    i, j = index_symbol("i"), index_symbol("j")
    flat = VIEW_KINDS["reshape"].index([i, j], _shape((24,)), _shape((4, 6)), {"shape": _shape((4, 6))})
    back = VIEW_KINDS["reshape"].index(flat, _shape((4, 6)), _shape((24,)), {"shape": _shape((24,))})
    offset = sympy.expand(back[0] * 6 + back[1])
    assert simplify_index(offset, {i: I(4), j: I(6)}) == 6 * i + j


def test_broadcast_index():
    i, j = index_symbol("i"), index_symbol("j")
    assert broadcast_index([i, j], _shape((1, 8)), _shape((4, 8))) == [0, j]
    assert broadcast_index([i, j], _shape((8,)), _shape((4, 8))) == [j]
    assert broadcast_index([i, j], _shape((4, 1)), _shape((4, 8))) == [i, 0]
    assert broadcast_index([i, j], (), _shape((4, 8))) == []


# -- simplify_index -----------------------------------------------------------------------

x, a, b = index_symbol("x"), index_symbol("a"), index_symbol("b")
s = sympy.Symbol("s", integer=True, positive=True)

SIMPLIFY_TABLE = [
    # (expression, ranges, expected)
    (IndexMod(x, 16), {x: I(16)}, x),
    (IndexDiv(x, 16), {x: I(16)}, I(0)),
    (IndexMod(x, 16), {x: I(32)}, IndexMod(x, 16)),  # not provable: unchanged
    (IndexDiv(x, 16), {x: I(32)}, IndexDiv(x, 16)),
    (IndexDiv(16 * a + b, 16), {a: I(4), b: I(16)}, a),
    (IndexMod(16 * a + b, 16), {a: I(4), b: I(16)}, b),
    (IndexDiv(16 * a + b, 16), {a: I(4), b: I(17)}, IndexDiv(16 * a + b, 16)),
    (16 * IndexDiv(x, 16) + IndexMod(x, 16), {x: I(1000)}, x),  # merge-then-split recombines
    (3 * (16 * IndexDiv(x, 16) + IndexMod(x, 16)) + 1, {x: I(1000)}, 3 * x + 1),
    (IndexMod(x, s), {x: s}, x),  # symbolic range
    (IndexDiv(s * a + b, s), {a: I(4), b: s}, a),
    (IndexMod(IndexDiv(x, 4), 8), {x: I(32)}, IndexDiv(x, 4)),
]


@pytest.mark.parametrize("expr,ranges,expected", SIMPLIFY_TABLE, ids=[str(e) for e, _, _ in SIMPLIFY_TABLE])
def test_simplify_index(expr, ranges, expected):
    got = simplify_index(sympy.expand(expr), ranges)
    assert sympy.expand(got - expected) == 0, f"simplify_index({expr}, {ranges}) = {got}, expected {expected}"


@pytest.mark.parametrize("expr,ranges", [(e, r) for e, r, _ in SIMPLIFY_TABLE if not (set(r.values()) & {s})])
def test_simplify_index_preserves_values(expr, ranges):
    """Whatever the simplification, the value at every index in range is unchanged."""
    got = simplify_index(sympy.expand(expr), ranges)
    syms = sorted(ranges, key=lambda v: v.name)
    for point in itertools.product(*(range(int(ranges[v])) for v in syms)):
        env = dict(zip(syms, (I(p) for p in point)))
        assert expr.xreplace(env) == got.xreplace(env), f"{expr} vs {got} at {env}"


# -- strides_of: when a view of a strided buffer is itself strided -----------------------------


def _syms(n):
    return [index_symbol(f"a{k}") for k in range(n)]


def _chain(kind, s_in, attrs):
    s_out = VIEW_KINDS[kind].shape(s_in, attrs)
    return (lambda index: VIEW_KINDS[kind].index(index, s_in, s_out, attrs)), s_out


def test_strides_of_permute():
    fn, s_out = _chain("permute", _shape((2, 3, 4)), {"dims": (2, 0, 1)})
    assert strides_of(fn, s_out, (I(12), I(4), I(1)), _syms(3)) == ((1, 12, 4), 0)


def test_strides_of_step_slice():
    attrs = {"dim": 1, "start": I(1), "end": I(10), "step": I(2)}
    fn, s_out = _chain("slice", _shape((4, 10)), attrs)
    assert strides_of(fn, s_out, (I(10), I(1)), _syms(2)) == ((10, 2), 1)


def test_strides_of_select():
    fn, s_out = _chain("select", _shape((3, 4, 5)), {"dim": 1, "index": I(2)})
    assert strides_of(fn, s_out, (I(20), I(5), I(1)), _syms(2)) == ((20, 1), 10)


def test_strides_of_contiguous_reshape():
    fn, s_out = _chain("reshape", _shape((4, 6)), {"shape": _shape((2, 2, 6))})
    assert strides_of(fn, s_out, (I(6), I(1)), _syms(3)) == ((12, 6, 1), 0)


def test_strides_of_non_affine_reshape_is_none():
    """Flattening a transposed buffer is not a strided view: it needs div/mod."""
    fn, s_out = _chain("reshape", _shape((4, 6)), {"shape": _shape((24,))})
    assert strides_of(fn, s_out, (I(1), I(4)), _syms(1)) is None
