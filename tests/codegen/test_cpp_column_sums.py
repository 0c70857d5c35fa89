"""C++ sums over rows of columns contiguous in memory (bias and norm-weight gradients): rendered a tile of
columns at a time (cpp.column_tile), every row adding into the tile's accumulators along the columns,
and checked against eager, with tails, several row dims, a per-column epilogue, bf16 and NaN/inf."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ember_compile, explain_strict, repro


def bias_and_weight_grads(g, x, scale):
    """A linear layer's bias gradient, a norm weight's (g * x summed over the rows), and a mean with a
    per-column epilogue: each a sum over every dim but the last."""
    dims = tuple(range(g.dim() - 1))
    return g.sum(dims), (g * x).sum(dims), g.float().mean(dims) * scale + 1


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((128, 1024), torch.float32),
        ((7, 33), torch.float32),
        ((300, 65), torch.float32),
        ((5, 3, 130), torch.float32),
        ((64, 200), torch.bfloat16),
    ],
)
def test_column_sums_run_in_column_tiles_and_match_eager(shape, dtype):
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
    sources = [k.source for k in explain_strict(bias_and_weight_grads, g, x, scale).kernels]
    assert any("l0_tile" in s for s in sources), "\n\n".join(sources)


def test_row_sums_keep_their_row_loop():
    # Rows contiguous along the summed dim (softmax's, layer norm's) are not column sums.
    x = torch.randn(64, 300)
    (kernel,) = explain_strict(lambda x: x.sum(-1), x).kernels
    assert "l0_tile" not in kernel.source, kernel.source
    torch.testing.assert_close(ember_compile(lambda x: x.sum(-1), "cpp")(x), x.sum(-1), rtol=1e-5, atol=1e-5)


def test_column_tile_one_keeps_the_strided_loop():
    x = torch.randn(128, 256)
    fn = lambda x: x.sum(0)
    (kernel,) = explain_strict(fn, x, heuristics="cpp.column_tile=1").kernels
    assert "l0_tile" not in kernel.source, kernel.source
    compiled = ember_compile(fn, "cpp", heuristics="cpp.column_tile=1")
    torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5)
