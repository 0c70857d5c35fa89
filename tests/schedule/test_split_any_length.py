"""Long reductions split whatever their length factors into (schedule/split.py).

A length whose only power-of-two factor is small (a prime; 2^31 + 10 = 2 x (2^30 + 5)) must still
split: one accumulator per SIMD lane over 300,000,007 ones stops growing at 2^24 (268435456.0).
Such lengths are cut into the
chunks wanted, the last one overlapping the one before (views.py's `chunks`), with a sum masking
the overlap out. The split is checked on the IR (no tensor of that size is made), the index map
of the view element by element, and the results against eager on both backends at small sizes.
"""

from __future__ import annotations

import pytest
import sympy
import torch

from ember.backends.cpp import CppBackend
from ember.backends.triton import TritonBackend
from ember.ir.views import VIEW_KINDS
from ember.schedule.split import split_reductions
from tests.helpers import BACKENDS, assert_close, assert_no_fallback, ember_compile, reports, repro
from tests.schedule.test_fusion import G


@pytest.mark.parametrize("size,count,length", [(10, 3, 4), (11, 2, 8), (4099, 16, 257), (7, 7, 1)])
def test_chunks_view_covers_every_position_and_overlaps_only_the_last_chunk(size, count, length):
    index = VIEW_KINDS["chunks"].index
    k, j = sympy.symbols("k j", integer=True, nonnegative=True)
    (expr,) = index([k, j], (sympy.Integer(size),), None, {"dim": 0, "count": count, "length": length})
    read = [[int(expr.subs({k: a, j: b})) for b in range(length)] for a in range(count)]
    overlap = count * length - size
    assert read[-1][-1] == size - 1  # the last chunk ends at the base's end
    assert all(read[a] == list(range(a * length, (a + 1) * length)) for a in range(count - 1))
    # Without the last chunk's first `overlap` elements (masked by a sum) every position is read once.
    kept = [p for row in read[:-1] for p in row] + read[-1][overlap:]
    assert sorted(kept) == list(range(size))


CPP, TRITON = CppBackend().target(), TritonBackend().target()


def _split_sum(shape, dims, kind="sum", target=CPP):
    """Split one reduction of an input of `shape` (only IR: nothing of that size is allocated);
    returns the first stage's input view (the chunks) and the reductions after the split."""
    b = G()
    x = b.input(*shape)
    b.g.outputs = [b.reduce(kind, x, dims)]
    assert split_reductions(b.g, target) == 1, f"{kind} over {dims} of {shape} was not split"
    reduces = [n for n in b.g.nodes if n.op == "reduce"]
    (chunks,) = [n for n in b.g.nodes if n.op == "view" and (n.attrs["kind"] == "chunks" or n.inputs[0] is x)]
    return chunks, reduces


@pytest.mark.parametrize("target", [CPP, TRITON], ids=["cpp", "triton"])
@pytest.mark.parametrize("n", [300_000_007, 2**31 + 10, 10**8], ids=["prime", "2^31+10", "1e8"])
def test_a_long_sum_splits_into_the_chunks_wanted_whatever_its_factors(n, target):
    chunks, (partial, final) = _split_sum((n,), (0,), target=target)
    count, length = int(chunks.out.shape[0]), int(chunks.out.shape[1])
    # As many chunks as a power of two would give: the target's, not 2 (2^31 + 10) or 1 (a prime).
    partials = target.heuristics.split.partials
    assert partials // 2 < count <= partials, f"{count} chunks of {length}"
    assert (count - 1) * length < n <= count * length
    assert chunks.attrs["kind"] == "chunks"
    # The sum masks the overlap: it reads where(keep, chunks, 0), not the view itself.
    assert partial.inputs[0].node.op == "pointwise" and partial.inputs[0].node.attrs["fn"] == "where"
    assert final.inputs[0] is partial.out


def test_a_row_sum_of_a_length_with_no_large_power_of_two_splits_every_row():
    chunks, (partial, _) = _split_sum((4, 2**26 + 3), (1,))
    assert tuple(int(s) for s in partial.out.shape) == (4, CPP.heuristics.split.partials // 4)
    assert chunks.attrs["dim"] == 1


def test_a_max_reads_the_overlap_twice_unmasked():
    chunks, (partial, _) = _split_sum((1_000_003,), (0,), kind="max")
    assert chunks.attrs["kind"] == "chunks" and partial.inputs[0] is chunks.out


def test_a_length_with_a_large_power_of_two_splits_by_reshape():
    chunks, _ = _split_sum((2**20 * 3,), (0,))  # as before: no overlap, no mask
    assert chunks.attrs["kind"] == "reshape" and tuple(int(s) for s in chunks.out.shape) == (8192, 384)


def test_the_first_of_several_reduced_dims_splits_whatever_its_size():
    # Batch norm's statistics with 67 images (a prime): 14 chunks of 5 images each, not one row of
    # 67 x 8 x 8 per channel.
    chunks, (partial, _) = _split_sum((67, 8, 8, 8), (0, 2, 3))
    assert chunks.attrs == {"kind": "chunks", "dim": 0, "count": 14, "length": 5}
    assert tuple(int(s) for s in partial.out.shape) == (14, 8)


# Small lengths that factor badly (4099 and 4111 are prime, 8194 = 2 x 4097), split on both backends.
CASES = [
    ("sum", (4099,), None),
    ("mean", (3, 8194), 1),
    ("sum", (2, 3, 4111), (1, 2)),
    ("sum", (67, 3, 64), (0, 2)),
    ("amax", (4099,), None),
    ("amin", (67, 3, 64), (0, 2)),
    ("var", (4099,), None),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,shape,dim", CASES, ids=[f"{op}-{'x'.join(map(str, s))}-dim{d}" for op, s, d in CASES])
def test_split_of_any_length_matches_eager(backend, op, shape, dim):
    def fn(x):
        y = x * 1.5 + 0.25
        return getattr(y, op)() if dim is None else getattr(y, op)(dim)

    x = torch.randn(shape)
    line = repro(backend=backend, op=op, dim=dim, input=x)
    with reports() as report:
        got = ember_compile(fn, backend)(x)
    assert_close(got, fn(x), rtol=1e-5, atol=1e-5, what=op, line=line)
    assert_no_fallback(report, line)
    # Split: a first stage over chunks, a second over the partial results.
    assert sum(len(g.kernels) for g in report.graphs) >= 2, f"not split:\n{report.graphs}\n{line}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_integer_and_bool_sums_of_a_prime_length_are_exact(backend):
    def fn(i, b):
        return i.sum(), b.sum(), (i > 0).sum()

    i = torch.randint(-1000, 1000, (4099,), dtype=torch.int32)
    b = torch.rand(4099) > 0.5
    line = repro(backend=backend, input=(i, b))
    with reports() as report:
        got = ember_compile(fn, backend)(i, b)
    for g, w in zip(got, fn(i, b)):
        assert g.dtype == w.dtype and g.item() == w.item(), f"{g} != {w}\n{line}"
    assert_no_fallback(report, line)
    assert sum(len(g.kernels) for g in report.graphs) >= 2, f"not split:\n{report.graphs}\n{line}"
