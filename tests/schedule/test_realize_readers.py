"""A node that reads a value twice (`d * d`) is one reader of it: the value is not stored for
that reader to read back. A split sum of squared differences stays two kernels (partial sums and
their total) that compute `a - b` where they use it, as eager's result. A chain of normalizations
is stored along the way rather than re-run by every later kernel."""

from __future__ import annotations

import torch

from ember.target import RealizeHeuristics
from tests.helpers import assert_close, ember_compile, reports, repro


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


def _normalizations(x, count: int):
    for _ in range(count):
        x = x - x.mean(0, keepdim=True)
        x = x * torch.rsqrt((x * x).mean(1, keepdim=True) + 1.0)
    return x


def test_a_chain_of_normalizations_is_stored_along_the_way():
    """Each normalization adds its statistics to the next value's inlined expression: without a
    bound, the k-th kernel would load all k-1 statistics before it and evaluate the chain again
    (quadratic work). A value read by two kernels whose expression loads `inlined_loads` buffers is
    stored, so no kernel loads many more than that, however long the chain."""
    x = torch.randn(16, 32)  # statistics much smaller than the values (else bytes alone store them)
    with reports() as report:
        got = ember_compile(lambda t: _normalizations(t, 20), "triton")(x)
    line = repro(program="normalizations", count=20, x=x)
    assert_close(got, _normalizations(x, 20), rtol=1e-4, atol=1e-5, what="chain", line=line)
    (graph,) = report.graphs
    loads = [k.source.count("tl.load(") for k in graph.kernels]
    assert len(graph.kernels) == 40, line
    assert max(loads) <= RealizeHeuristics().inlined_loads, (loads, line)
