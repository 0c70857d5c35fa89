"""Window interiors on the C++ target (codegen/cpp_interior.py): a pointwise kernel whose `where`s check
window bounds runs its vector loop twice, inside the box where every check holds (checks folded, clamps
dropped, a row's positions `cpp.window_jam` at a time) and elsewhere as before.

End to end, over windows of every kind ember's C++ kernels compute (depthwise convolutions with padding,
stride, dilation and TensorFlow-style pads, max pools, a pad fused into its reader, images smaller than a block
or than the window): the same results as the one-body kernel and as eager, with the interior written
where it applies and its loops vectorized. Then the box, the folded nodes and the clamps, unit by unit."""

from __future__ import annotations

import re

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

from ember.codegen.cpp_interior import _bound, expr_range, interior, simplify_clamps
from ember.schedule.kernel import KConst, KIndex, KLoad, KOp
from tests.aten.test_depthwise_convolution import DepthwiseBlock
from tests.helpers import (
    assert_close,
    assert_no_fallback,
    cpp_simd_loops_vectorized,
    ember_compile,
    randomize_bn,
    reports,
    repro,
)

TOL = {"rtol": 1e-4, "atol": 1e-4}


class Pool(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# name -> (module, input shape, whether the kernel has an interior); channels last but where named "rows"
CASES = {
    "depthwise-3x3": (lambda: DepthwiseBlock(16), (1, 16, 13, 13), True),
    "depthwise-3x3-batch3": (lambda: DepthwiseBlock(8), (3, 8, 10, 11), True),
    # row-major: the vector loop walks a row, and each tap's one check of both coordinates varies along it:
    # no pick, no interior (the one-loop kernel, as before)
    "depthwise-3x3-rows": (lambda: DepthwiseBlock(8), (2, 8, 11, 12), False),
    "depthwise-5x5-stride2": (lambda: DepthwiseBlock(8, k=5, stride=2, padding=2), (1, 8, 19, 19), True),
    "depthwise-7x7": (lambda: DepthwiseBlock(24, k=7, padding=3), (1, 24, 16, 16), True),
    "depthwise-dilated": (lambda: DepthwiseBlock(8, padding=2, dilation=2), (1, 8, 14, 12), True),
    "depthwise-tf-pad-stride2": (
        lambda: DepthwiseBlock(8, stride=2, padding=0, pad=(0, 1, 0, 1)),
        (1, 8, 16, 16),
        True,
    ),
    # no padding: no bounds to check, but a window's taps along the row, computed a block at a time
    "depthwise-valid": (lambda: DepthwiseBlock(8, padding=0), (1, 8, 12, 13), True),
    # a box narrower than a block (one position at a time inside it), and a window wider than the image
    "depthwise-narrow-box": (lambda: DepthwiseBlock(8), (1, 8, 4, 4), True),
    "depthwise-no-box": (lambda: DepthwiseBlock(8, k=5, padding=2), (1, 8, 3, 3), False),
    "max-pool-stem": (lambda: Pool(lambda x: F.max_pool2d(x, 3, 2, 1)), (2, 16, 15, 15), True),
    "max-pool-stride1": (lambda: Pool(lambda x: F.max_pool2d(x, 3, 1, 1)), (1, 16, 9, 10), True),
    "pad-into-reader": (lambda: Pool(lambda x: F.pad(x, (2, 1, 1, 2)).relu() * 2), (1, 16, 9, 9), True),
}


def _compile(name, **heuristics):
    make, shape, _ = CASES[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    layout = torch.contiguous_format if "rows" in name else torch.channels_last
    model = randomize_bn(make()).eval().to(memory_format=layout)
    x = torch.randn(shape).to(memory_format=layout)
    text = ",".join(f"cpp.{k}={v}" for k, v in heuristics.items())
    with torch.no_grad(), reports() as report:
        expected = model(x)
        actual = ember_compile(model, "cpp", freezing=True, heuristics=text)(x)
    line = repro(case=name, heuristics=text)
    assert_no_fallback(report, line)
    assert_close(actual, expected, **TOL, what=name, line=line)
    sources = [k.source for g in report.graphs for k in g.kernels]
    return actual, sources, line


@pytest.mark.parametrize("name", CASES)
def test_interior_matches_one_body_and_eager(name):
    jammed, sources, line = _compile(name, window_jam=4)
    single, _, _ = _compile(name, window_jam=1)
    plain, plain_sources, _ = _compile(name, window_interiors=0)
    assert_close(jammed, plain, rtol=1e-6, atol=1e-6, what=f"{name}: four positions at a time", line=line)
    assert_close(single, plain, rtol=1e-6, atol=1e-6, what=f"{name}: one position at a time", line=line)
    has_interior = CASES[name][2]
    written = [s for s in sources if "_start" in s]
    assert bool(written) == has_interior, f"interior written: {bool(written)}\n{line}"
    assert not any("_start" in s for s in plain_sources), line
    for source in written:  # every vector loop, inside the box and at its border
        loops = cpp_simd_loops_vectorized(source)
        assert loops and all(loops), f"vectorized: {loops}\n{source}\n{line}"


def test_a_block_reads_the_weights_once_for_its_positions():
    """Inside the box a block of four pixels loads each of the nine weights once, and each pixel's nine taps."""
    _, sources, line = _compile("depthwise-3x3", window_jam=4)
    (source,) = [s for s in sources if "_start" in s]
    block = source.split("_start + 4 <=", 1)[1].split("} else {", 1)[0]
    loads = re.findall(r"= in_v\d+\[", block)
    # 9 weights + 2 batch-norm affine values, once; 9 taps for each of 4 pixels
    assert len(loads) == 9 + 2 + 4 * 9, f"{len(loads)} loads\n{block}\n{line}"
    assert "ember_pick" not in block and "ember_min_index" not in block, block


# -- units ------------------------------------------------------------------------------------

L0, L1, L2 = sympy.symbols("l0 l1 l2", integer=True)


def same(expr):
    """The kernel's index rewrite (Kernel.index), here none."""
    return expr


def _index(expr):
    return KIndex(torch.int64, False, 0, expr)


def _op(fn, *operands, dtype=torch.bool):
    return KOp(dtype, False, 0, fn, operands)


def _const(v, dtype=torch.int64):
    return KConst(dtype, False, 0, v)


def test_bounds_from_comparisons_of_one_variable():
    cases = [
        (_op("ge", _index(L0 - 1), _const(0)), (1, None)),  # l0 - 1 >= 0
        (_op("lt", _index(L0 - 1), _const(12)), (None, 13)),  # l0 - 1 < 12
        (_op("gt", _index(2 * L0 - 3), _const(0)), (2, None)),  # 2 l0 - 3 > 0: l0 >= 2
        (_op("le", _index(2 * L0 + 1), _const(10)), (None, 5)),  # 2 l0 + 1 <= 10: l0 <= 4
        (_op("ge", _const(7), _index(L0 + 2)), (None, 6)),  # 7 >= l0 + 2: l0 <= 5
        (_op("lt", _index(-L0 + 4), _const(1)), (4, None)),  # 4 - l0 < 1: l0 > 3
    ]
    for atom, (lo, hi) in cases:
        var, got_lo, got_hi = _bound(atom, same, [L0, L1])
        assert var == L0
        assert (got_lo if lo is not None else None, got_hi if hi is not None else None) == (lo, hi), atom
    # two variables, or the vector loop's: no bound
    assert _bound(_op("ge", _index(L0 + L1), _const(0)), same, [L0, L1]) is None
    assert _bound(_op("ge", _index(L2 - 1), _const(0)), same, [L0, L1]) is None


def test_the_box_folds_the_checks_it_holds_and_keeps_the_others():
    top = _op("ge", _index(L0 - 1), _const(0))
    bottom = _op("lt", _index(L0 + 1), _const(8))
    left = _op("ge", _index(L1 - 2), _const(0))
    across = _op("ge", _index(L0 - L1), _const(0))  # not one variable's: stays a check
    inside = _op("logical_and", _op("logical_and", top, bottom), left)
    pick = _op("where", inside, _const(1.0, torch.float32), _const(0.0, torch.float32), dtype=torch.float32)
    other = _op("where", across, _const(1.0, torch.float32), _const(0.0, torch.float32), dtype=torch.float32)
    # a tap read along the row, times a weight read along the channels (the vector loop) only
    image, weights = object(), object()
    tap = KLoad(torch.float32, False, 0, image, 160 * L0 + 16 * L1 + L2)
    weight = KLoad(torch.float32, False, 0, weights, L2)
    product = _op("mul", tap, weight, dtype=torch.float32)
    nodes = [top, bottom, left, across, inside, pick, other, tap, weight, product]
    loops = [(L0, sympy.Integer(8)), (L1, sympy.Integer(10)), (L2, sympy.Integer(16))]
    found = interior(nodes, same, loops, [pick, other], jam=4)
    assert found is not None
    assert found.box == {L0: (1, 7), L1: (2, 10)}
    assert all(found.facts.get(id(n)) == 1 for n in (top, bottom, left, inside))
    assert id(across) not in found.facts
    assert (found.var, found.jam, found.origin) == (L1, 4, -2)  # blocks start at 2: -2, 2, 6
    assert found.condition("s") == "l0 >= 1 && l0 < 7 && s >= 2 && s + 4 <= 10"
    assert {id(weight), id(top), id(bottom)} <= found.fixed and not {id(tap), id(product), id(left)} & found.fixed
    # a transcendental op per position (a SiLU after the taps): one position at a time
    costly = _op("sigmoid", product, dtype=torch.float32)
    assert interior([*nodes, costly], same, loops, [pick, other], jam=4).jam == 1
    # a box narrower than a block: one position at a time
    narrow = interior(nodes, same, [(L0, sympy.Integer(8)), (L1, sympy.Integer(4)), (L2, sympy.Integer(16))], [pick])
    assert narrow is not None and narrow.jam == 1
    # an empty box, or no check the box decides: no interior
    empty = [(L0, sympy.Integer(1)), (L1, sympy.Integer(10)), (L2, sympy.Integer(16))]
    assert interior(nodes, same, empty, [pick, other], jam=4) is None
    assert interior([across, other], same, loops, [other], jam=4) is None


def test_clamps_the_ranges_decide_are_dropped():
    ranges = {L0: (1, 6), L1: (0, 15)}
    clamped = 32 * sympy.Min(7, sympy.Max(0, L0 - 1)) + L1
    assert simplify_clamps(clamped, ranges) == 32 * (L0 - 1) + L1
    still = sympy.Min(5, L0)  # l0 reaches 6: the clamp stays
    assert simplify_clamps(still, ranges) == still
    assert expr_range(3 * L0 - sympy.Max(L1, 2), ranges) == (3 - 15, 18 - 2)
