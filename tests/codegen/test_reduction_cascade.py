"""Long floating sums accumulate in blocks whose sums are added up, not in one running value.

One running fp32 value per SIMD lane (C++) or per RBLOCK lane (Triton) adds row / lanes elements
in a row: its error grows with the row, and past 2^24 times the element it stops growing (a row of
300,000,007 ones summed to 268435456.0). Rows too long for that (or of a size known only at run
time) are summed in blocks, each from zero: C++ adds the blocks' sums pairwise (ember_cascade),
Triton adds each lane's block sums. Checked on the rendered source, then on results: a sum of
copies of 0.1, whose rounding errors all lean one way, against float64.
"""

from __future__ import annotations

import re

import pytest
import sympy
import torch

from ember.codegen.cpp import render_cpp
from ember.codegen.triton import render_triton
from tests.helpers import ember_compile, repro
from tests.schedule.test_fusion import CPP, TRITON, G

BLOCKS = CPP.heuristics.cpp  # cascade_block, cascade_min_row


def _kernel(shape, dims, kind="sum", dtype=torch.float32, also=None):
    """The one kernel of a reduction of an input of `shape` (no split: the IR is scheduled as is)."""
    b = G()
    x = b.input(*shape, dtype=dtype)
    outs = [b.reduce(kind, x, dims)]
    if also:
        outs.append(b.reduce(also, x, dims))
    (k,) = b.schedule(*outs).kernels
    return k


ROW = sympy.Symbol("s0", integer=True, positive=True)


@pytest.mark.parametrize(
    "shape,dims",
    [((2, BLOCKS.cascade_min_row + 1), (1,)), ((2, ROW), (1,)), ((3, 2, 2000), (0, 2)), ((ROW, 2, 7), (0, 2))],
    ids=["long-row", "symbolic-row", "two-loops", "two-loops-symbolic"],
)
def test_cpp_sums_long_rows_in_blocks_added_pairwise(shape, dims):
    source, _ = render_cpp(_kernel(shape, dims, also="max"), CPP)
    assert "ember_cascade<float> acc1_sums;" in source and ".total()" in source, source
    assert re.search(rf"\+= {BLOCKS.cascade_block}\)", source), source  # the innermost loop, cut into blocks
    # The max beside the sum keeps its one running value: it does not round.
    assert source.count("ember_cascade") == 1, source


@pytest.mark.parametrize(
    "shape,dims,kind,dtype",
    [
        ((2, BLOCKS.cascade_min_row), (1,), "sum", torch.float32),
        ((2, 100_000), (1,), "sum", torch.int32),
        ((2, 100_000), (1,), "max", torch.float32),
    ],
    ids=["short-row", "integer", "max"],
)
def test_cpp_keeps_one_loop_where_nothing_rounds_much(shape, dims, kind, dtype):
    source, _ = render_cpp(_kernel(shape, dims, kind, dtype), CPP)
    assert "ember_cascade" not in source and "_block" not in source, source


def test_triton_sums_long_looped_rows_in_blocks_per_lane():
    steps = TRITON.heuristics.launch.cascade_steps
    for shape in [(2, ROW), (2, 2048 * steps + 1)]:  # unknown length; `steps` + 1 steps of 2048
        kernel = render_triton(_kernel(shape, (1,)), TRITON)
        assert kernel.launch.rblock == 2048 and not kernel.launch.persistent
        source = kernel.source
        assert f"for rblock in range(0, rnumel, RBLOCK * {steps}):" in source, source
        assert "rindex = rblock + roffset + rbase" in source, source
        assert "acc1_block = acc1_block + tl.where(" in source and "acc1 = acc1 + acc1_block" in source, source
    short = render_triton(_kernel((2, 2048 * steps), (1,)), TRITON).source  # a lane adds `steps` elements
    assert "rblock" not in short, short


@pytest.mark.parametrize("backend,n", [("cpp", 2**24 + 43), ("triton", 2**20 + 3)])
def test_a_long_row_of_tenths_sums_as_accurately_as_eager(backend, n):
    # Dynamic: the row is not split (its size is symbolic), so the kernel's accumulation is all there is.
    x = torch.full((n,), 0.1)
    line = repro(backend=backend, input=x)
    got = ember_compile(lambda x: x.sum(), backend, dynamic=True)(x)
    want = n * float(x[0])  # exact in float64: 24 bits of 0.1 times 25 bits of n
    err, eager_err = abs(got.item() - want) / want, abs(x.sum().item() - want) / want
    bound = 4 * max(eager_err, 2**-24)
    assert err <= bound, f"relative error {err:.3g}, eager's {eager_err:.3g}\n{line}"


def test_cpp_sums_rows_read_with_a_stride_in_short_blocks():
    """A row whose loads step by more than one element (the columns of a [512, 3] input) may be
    summed by a scalar loop: it is cut into blocks of cpp.strided_cascade_block elements, where a
    contiguous row that long keeps its one loop."""
    strided, _ = render_cpp(_kernel((512, 3), (0,)), CPP)
    assert "ember_cascade<float>" in strided, strided
    assert re.search(rf"\+= {BLOCKS.strided_cascade_block}\)", strided), strided
    contiguous, _ = render_cpp(_kernel((3, 512), (1,)), CPP)
    assert "ember_cascade" not in contiguous, contiguous
    short, _ = render_cpp(_kernel((BLOCKS.strided_cascade_block, 3), (0,)), CPP)
    assert "ember_cascade" not in short, short
