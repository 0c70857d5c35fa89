"""C++ sums over rows of columns contiguous in memory (bias and norm-weight gradients): rendered a tile of
columns at a time (cpp.column_tile), every row adding into the tile's accumulators along the columns,
where there are at least two tiles of columns, the rows need no cascade and the sums' per-column values
are loads. Each case is checked against eager, tiled or not, with tails, several row dims, a per-column
epilogue, bf16, NaN/inf and an input written in place."""

from __future__ import annotations

import pytest
import torch

from ember.ir import ops
from tests.helpers import ember_compile, explain_strict, repro


def bias_and_weight_grads(g, x, scale):
    """A linear layer's bias gradient, a norm weight's (g * x summed over the rows), and a mean with a
    per-column epilogue: each a sum over every dim but the last."""
    dims = tuple(range(g.dim() - 1))
    return g.sum(dims), (g * x).sum(dims), g.float().mean(dims) * scale + 1


def _tiled(fn, *args, **options) -> bool:
    return any("l0_tile" in k.source for k in explain_strict(fn, *args, **options).kernels)


@pytest.mark.parametrize(
    "shape,dtype,tiled",
    [
        ((128, 1024), torch.float32, True),
        ((300, 200), torch.float32, True),
        ((5, 3, 130), torch.float32, True),
        ((64, 200), torch.bfloat16, True),
        ((7, 33), torch.float32, False),  # fewer than two tiles of columns
        ((5000, 16), torch.float32, False),
        ((4097, 130), torch.float32, None),  # the split pass cuts the long column into partial sums
    ],
)
def test_column_sums_match_eager_in_column_tiles_where_they_apply(shape, dtype, tiled):
    g, x = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    rows = g.view(-1, shape[-1])
    rows[1, 3] = float("nan")
    rows[2, 5] = float("inf")
    scale = torch.randn(shape[-1])
    line = repro(shape=shape, dtype=dtype)
    got, want = ember_compile(bias_and_weight_grads, "cpp")(g, x, scale), bias_and_weight_grads(g, x, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for k, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(
            a, b, rtol=tol, atol=tol, equal_nan=True, msg=lambda m, k=k: f"output {k}: {m}\n{line}"
        )
    if tiled is not None:
        assert _tiled(bias_and_weight_grads, g, x, scale) == tiled, line


def gated_sums(g, b, c):
    """A per-column value that is more than a load inside a sum (sigmoid(b)), an epilogue of its own, and
    a sum added into an input in place."""
    c.add_((g * c).sum(0))
    return ((g * b.sigmoid()).sum(0) + b) * b.exp(), (g * g).sum(0)


@pytest.mark.parametrize("tile", [1, 64])
def test_per_column_values_and_in_place_inputs_match_eager_tiled_or_not(tile):
    g, b, c = torch.randn(300, 200), torch.randn(200), torch.randn(200)
    want_c = c.clone()
    want = gated_sums(g, b, want_c)
    got = ember_compile(gated_sums, "cpp", heuristics=f"cpp.column_tile={tile}")(g, b, c)
    for a, w in zip((*got, c), (*want, want_c)):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{m}\n{repro(tile=tile)}")
    # sigmoid(b) in a sum would be computed again for every row: no column-tiled kernel computes it (it is
    # computed once, in a kernel of its own, or in a kernel that keeps its row loop).
    sources = [k.source for k in explain_strict(gated_sums, g, b, c.clone()).kernels]
    sigmoid = ops.POINTWISE["sigmoid"].cpp.split("{0}")[0]  # how a sigmoid's rendering begins
    assert not any("l0_tile" in s and sigmoid in s for s in sources), "\n\n".join(sources)


def test_row_sums_keep_their_row_loop():
    # Rows contiguous along the summed dim (softmax's, layer norm's) are not column sums.
    x = torch.randn(64, 300)
    assert not _tiled(lambda x: x.sum(-1), x)
    torch.testing.assert_close(ember_compile(lambda x: x.sum(-1), "cpp")(x), x.sum(-1), rtol=1e-5, atol=1e-5)


def test_column_tile_one_keeps_the_strided_loop():
    x = torch.randn(128, 256)
    fn = lambda x: x.sum(0)
    assert _tiled(fn, x) and not _tiled(fn, x, heuristics="cpp.column_tile=1")
    compiled = ember_compile(fn, "cpp", heuristics="cpp.column_tile=1")
    torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5)


def rms_norm_backward(g, x, rstd, w):
    """RMSNorm's backward at one kernel: the weight's gradient sums g * x * rstd over the rows (rstd one
    value per row), and the input's gradient is stored at every element in the same loop."""
    return (g * x * rstd).sum(0), g * w * rstd + x * (rstd * 2.0 / x.shape[-1])


@pytest.mark.parametrize("rows,cols", [(128, 256), (33, 200)])
def test_a_per_row_scale_and_a_per_element_store_run_in_column_tiles(rows, cols):
    g, x, w = torch.randn(rows, cols), torch.randn(rows, cols), torch.randn(cols)
    rstd = torch.rand(rows, 1) + 0.5
    line = repro(rows=rows, cols=cols)
    got, want = ember_compile(rms_norm_backward, "cpp")(g, x, rstd, w), rms_norm_backward(g, x, rstd, w)
    for k, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"output {k}: {m}\n{line}")
    assert _tiled(rms_norm_backward, g, x, rstd, w), line
