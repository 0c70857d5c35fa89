"""A node that reads a value twice (`d * d`) is one reader of it: the value is not stored for
that reader to read back. A split sum of squared differences stays two kernels (partial sums and
their total) that compute `a - b` where they use it, as eager's result."""

from __future__ import annotations

import torch

from tests.helpers import assert_close, ember_compile, reports


def _squared_error(a, b):
    d = a - b
    return (d * d).sum()


def test_a_value_read_twice_by_one_node_is_not_stored():
    a, b = torch.randn(100003), torch.randn(100003)  # a prime length: the sum splits
    with reports() as report:
        got = ember_compile(_squared_error, "cpp")(a, b)
    assert_close(got, _squared_error(a, b), rtol=1e-5, atol=1e-3, what="sum", line="repro: squared error, n=100003")
    (graph,) = report.graphs
    assert len(graph.kernels) == 2, [k.origins for k in graph.kernels]
    assert graph.peak_bytes is not None and graph.peak_bytes < 4 * 100003, graph.memory
