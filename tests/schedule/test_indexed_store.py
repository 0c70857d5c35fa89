"""A write into rows of a graph input (a static KV cache's `index_copy_`, `cache[:, :, pos] = k`), stored
by the kernel that computes the rows: checked against eager through Triton's interpreter, with the
kernel's report (the scatter among its ops, no ATen call), and the cases that must stay ATen calls.
"""

from __future__ import annotations

import pytest
import torch

from ember.report import collecting
from tests.helpers import assert_close, ember_compile, repro

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decode_step(k_cache, v_cache, pos, q, k, v, cos, sin):
    """One decode step of attention over a static cache, as HF's StaticCache writes it."""
    k_cache.index_copy_(2, pos, _rope(k, cos, sin))
    v_cache.index_copy_(2, pos, v * 1.0)
    scores = _rope(q, cos, sin) @ k_cache.transpose(-1, -2)
    return scores.softmax(-1) @ v_cache


def decode_inputs(batch=2, heads=2, length=8, dim=4, pos=(5,)):
    torch.manual_seed(0)
    step = len(pos)
    return (
        torch.randn(batch, heads, length, dim),
        torch.randn(batch, heads, length, dim),
        torch.tensor(pos),
        torch.randn(batch, heads, step, dim),
        torch.randn(batch, heads, step, dim),
        torch.randn(batch, heads, step, dim),
        torch.randn(1, 1, step, dim),
        torch.randn(1, 1, step, dim),
    )


def put_rows(cache, pos, k):
    cache[:, pos] = k * 2


def put_broadcast_rows(cache, pos, k):
    cache[:, pos] = k.sigmoid()  # k is [1, 1, D]: one row for every batch and position


def copy_at_computed_positions(cache, start, k):
    cache.index_copy_(1, start + torch.arange(k.shape[1]), k + 1)


def store_beside_a_row_sum(cache, pos, k):
    cache.index_copy_(1, pos, k + 1)  # every row of k written: the store may share the sum's kernel
    return (k * 2).sum(1)


def reads_old_rows_first(cache, pos, k):
    before = cache.sum(dim=1)
    cache.index_copy_(1, pos, k)
    return before


def reads_new_cache(cache, pos, k):
    return cache.index_copy_(1, pos, k).clone()


def functional_index_copy(cache, pos, k):
    return cache.index_copy(1, pos, k)  # no input is written: a new tensor


def _run(fn, args, **options):
    eager_args = [a.clone() for a in args]
    args = [a.clone() for a in args]
    torch._dynamo.reset()
    with collecting() as report:
        got = ember_compile(fn, "triton", **options)(*args)
    want = fn(*eager_args)
    line = repro(backend="triton", device="cpu", fn=fn.__name__)
    for k, (a, e) in enumerate(zip(args, eager_args)):
        assert_close(a, e, **TOL, what=f"input {k} after the call", line=line)
    if want is not None:
        assert_close(got, want, **TOL, what="result", line=line)
    (graph,) = report.graphs
    return graph, line


def _scatters(graph, op):
    """Kernels that store the scatter `op`, and ATen calls of it."""
    kernels = [k for k in graph.kernels if any(op in o for o in k.ops)]
    return kernels, [e for e in graph.externs if op in e]


def test_decode_step_stores_the_cache_rows_in_the_kernels_computing_them():
    graph, line = _run(decode_step, decode_inputs())
    kernels, calls = _scatters(graph, "index_copy")
    assert not calls, f"{graph.externs}\n{line}"
    assert len({k.name for k in kernels}) >= 1, line
    rope_store = [k for k in kernels if "cat" in k.ops or any("cat" in o for o in k.ops)]
    assert rope_store, f"the rotary embedding is not computed by the kernel storing it: {kernels}\n{line}"
    assert "index out of bounds" in rope_store[0].source and "debug=True" in rope_store[0].source, line
    assert len(graph.mutations) == 2 and all("written in place by" in m for m in graph.mutations), line


def test_prefill_writes_several_rows():
    _run(decode_step, decode_inputs(pos=(0, 1, 2, 3)))


@pytest.mark.parametrize(
    "fn,args,op",
    [
        (put_rows, (torch.zeros(2, 8, 4), torch.tensor([5, 1]), torch.randn(2, 2, 4)), "index_put"),
        (put_rows, (torch.zeros(2, 8, 4), torch.tensor([-1]), torch.randn(2, 1, 4)), "index_put"),  # the last row
        (put_broadcast_rows, (torch.zeros(3, 8, 4), torch.tensor([2, 6]), torch.randn(1, 1, 4)), "index_put"),
        (copy_at_computed_positions, (torch.zeros(2, 8, 4), torch.tensor(3), torch.randn(2, 2, 4)), "index_copy"),
        (reads_new_cache, (torch.randn(2, 8, 4), torch.tensor([3]), torch.randn(2, 1, 4)), "index_copy"),
        (store_beside_a_row_sum, (torch.zeros(4, 64), torch.randperm(64), torch.randn(4, 64)), "index_copy"),
    ],
    ids=["index_put", "index_put_negative", "index_put_broadcast", "computed_positions", "new_cache_read", "row_sum"],
)
def test_scatter_into_input_is_a_kernel_store(fn, args, op):
    graph, line = _run(fn, args)
    kernels, calls = _scatters(graph, op)
    assert kernels and not calls, f"{graph.kernels} {graph.externs}\n{line}"
    assert all("written in place by" in m for m in graph.mutations), f"{graph.mutations}\n{line}"


@pytest.mark.parametrize("fn", [reads_old_rows_first, functional_index_copy])
def test_stays_an_aten_call_where_the_old_cache_is_read_or_no_input_is_written(fn):
    graph, line = _run(fn, (torch.randn(2, 8, 4), torch.tensor([3]), torch.randn(2, 1, 4)))
    kernels, calls = _scatters(graph, "index_copy")
    assert calls and not kernels, f"{graph.kernels} {graph.externs}\n{line}"


def test_integer_cache_and_deterministic_mode_keep_the_aten_call():
    graph, line = _run(
        put_rows, (torch.zeros(2, 8, 4, dtype=torch.int32), torch.tensor([5]), torch.ones(2, 1, 4, dtype=torch.int32))
    )
    assert not _scatters(graph, "index_put")[0], line
    torch.use_deterministic_algorithms(True)
    try:
        graph, line = _run(decode_step, decode_inputs())
    finally:
        torch.use_deterministic_algorithms(False)
    assert not _scatters(graph, "index_copy")[0], line


def test_prefill_store_walks_the_rows_contiguously():
    """The kernel's innermost loop runs along the rows' last dim, not along the index (which strides by a row)."""
    graph, line = _run(decode_step, decode_inputs(batch=1, heads=2, length=16, dim=8, pos=(0, 1, 2, 3)))
    (store,) = [k for (k,) in [(k,) for k in graph.kernels] if any("index_copy" in o for o in k.ops) and "cat" in k.ops]
    assert "tmp" in store.source and "(xindex) % 8" in store.source, f"{store.source}\n{line}"


def test_setting_off_keeps_the_aten_call():
    graph, line = _run(decode_step, decode_inputs(), indexed_stores=False)
    kernels, calls = _scatters(graph, "index_copy")
    assert len(calls) == 2 and not kernels, f"{graph.externs}\n{line}"


def test_position_out_of_range_raises():
    args = list(decode_inputs())
    args[2] = torch.tensor([8])  # the cache has 8 rows
    torch._dynamo.reset()
    with pytest.raises(Exception, match="index out of bounds"):
        ember_compile(decode_step, "triton")(*args)
