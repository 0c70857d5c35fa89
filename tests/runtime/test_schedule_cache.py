"""A graph scheduled before is loaded from the disk cache: the kernels, fusion decisions, memory plan
and host program must be exactly those that scheduling it again gives, and its results eager's.
AOTAutograd's cache, which would serve these graphs before ember's schedule cache is asked, is off
here (tests/frontend/test_aot_cache.py covers it)."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
import torch._dynamo

import ember
from ember.runtime import schedule_cache
from ember.runtime.cache import DiskCache
from tests.helpers import assert_no_fallback, explain_strict, forward_backward, fresh_inputs, params_of, reports
from tests.schedule.test_fusion_ranking import ConvBlocks
from tests.schedule.test_fusion_ranking import _cases as training_cases


@pytest.fixture(autouse=True)
def _schedule_cache_alone(monkeypatch):
    monkeypatch.setenv("EMBER_AOT_CACHE", "0")


def _fingerprint(report) -> list:
    return [
        (
            g.kind,
            [(k.name, k.domain, k.source, k.bytes) for k in g.kernels],
            [str(f) for f in g.fusion],
            g.memory,
            g.host_source,
        )
        for g in report.graphs
    ]


def _explain_twice(model, inputs, backend):
    first = explain_strict(model, *inputs, backend=backend)
    torch._dynamo.reset()
    second = explain_strict(model, *inputs, backend=backend)
    return first, second


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_a_cached_schedule_is_the_schedule(backend, tmp_path):
    with ember.config.override(cache_dir=str(tmp_path)):
        for name, model, inputs in training_cases(backend):
            first, second = _explain_twice(model, inputs, backend)
            assert [g.kind for g in first.graphs] == ["forward", "backward"], name
            assert all("schedule" in g.stage_seconds and "cached schedule" not in g.stage_seconds for g in first.graphs)
            assert all(
                "cached schedule" in g.stage_seconds and "schedule" not in g.stage_seconds for g in second.graphs
            )
            assert _fingerprint(first) == _fingerprint(second), name


def test_a_cached_schedule_trains_as_eager(tmp_path):
    model = ConvBlocks().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    with ember.config.override(cache_dir=str(tmp_path), strict=True, backend="cpp"):
        explain_strict(model, x.clone().requires_grad_())  # fills the cache
        torch._dynamo.reset()
        with reports() as report:
            compiled = torch.compile(model, backend="ember")
            out, grads = forward_backward(compiled, params_of(model), fresh_inputs([x]), grad_seed=1, train=True)
    assert_no_fallback(report, "conv blocks, cached schedule")
    assert [g.kind for g in report.graphs] == ["forward", "backward"]
    assert all("cached schedule" in g.stage_seconds for g in report.graphs)
    ref_out, ref_grads = forward_backward(model, params_of(model), fresh_inputs([x]), grad_seed=1, train=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def _scheduled(fn, *args, **options) -> bool:
    torch._dynamo.reset()
    (graph,) = explain_strict(fn, *args, **options).graphs
    return "schedule" in graph.stage_seconds


def test_what_changes_a_schedule_changes_the_key(tmp_path):
    def fn(x, y):
        return torch.softmax(x * 2 + y, dim=-1)

    x, y = torch.randn(8, 32), torch.randn(8, 32)
    with ember.config.override(cache_dir=str(tmp_path)):
        assert _scheduled(fn, x, y)
        assert not _scheduled(fn, x, y)  # the same graph, inputs and settings: loaded
        assert _scheduled(fn, x, y, fuse=False)  # a setting that changes code
        assert _scheduled(fn, x.t().contiguous().t(), y)  # another input layout
        assert _scheduled(fn, torch.randn(8, 33), torch.randn(8, 33))  # another shape
        assert _scheduled(fn, x.double(), y.double())  # another dtype
        assert not _scheduled(fn, x, y, compile_threads=1)  # a setting that cannot change it
        assert _scheduled(fn, x, y, schedule_cache=False)
        assert _scheduled(fn, x, y, logs="graph")  # the passes' logs asked for: the passes run
        assert _scheduled(fn, x, y, gemm="auto")


def test_a_graph_with_symbolic_sizes_has_no_key(tmp_path):
    def fn(x):
        return torch.relu(x) + 1

    with ember.config.override(cache_dir=str(tmp_path), strict=True, backend="cpp"):
        torch._dynamo.reset()
        with reports() as report:
            compiled = torch.compile(fn, backend="ember", dynamic=True)
            compiled(torch.randn(6, 5))
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="ember", dynamic=True)
            compiled(torch.randn(6, 5))
    assert len(report.graphs) == 2 and all("schedule" in g.stage_seconds for g in report.graphs)


def test_an_entry_that_does_not_unpickle_is_a_miss(tmp_path):
    def fn(x):
        return torch.exp(x) * 3

    x = torch.randn(16, 16)
    with ember.config.override(cache_dir=str(tmp_path)):
        assert _scheduled(fn, x)
        (entry,) = (tmp_path / "schedule").glob("*/*")
        # A well-formed entry (manifest and checksum agree) holding a pickle this code cannot load.
        key = entry.name
        shutil.rmtree(entry)
        DiskCache().put("schedule", key, {"schedule.pickle": b"not a pickle"})
        assert schedule_cache.load(key) is None
        assert _scheduled(fn, x)


def test_a_captured_constant_comes_back_as_real_memory(tmp_path):
    # The graph captures the index tensor (FX get_attr). Loaded under AOTAutograd's fake mode it
    # came back a fake tensor, and the kernel reading it crashed the process.
    def fn(x):
        return x[torch.tensor([1, 2])] * 2

    x = torch.randn(5, 5, 5)
    with ember.config.override(cache_dir=str(tmp_path)):
        assert _scheduled(fn, x)
        assert not _scheduled(fn, x)
        torch._dynamo.reset()
        with ember.config.override(strict=True, backend="cpp"):
            torch.testing.assert_close(torch.compile(fn, backend="ember")(x), fn(x))


def test_a_zero_dim_constant_is_hashed_and_a_checked_load_verifies(tmp_path):
    def fn(x):
        return x * torch.tensor(2.5) + torch.tensor(1, dtype=torch.int64)

    x = torch.randn(8, 8)
    with ember.config.override(cache_dir=str(tmp_path)):
        assert _scheduled(fn, x)
        assert not _scheduled(fn, x, check=True)  # loaded, and the IR verifier ran on it


def _with_subgraph(body: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph that captures `body` as an attribute, as a higher-order op's caller does."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.get_attr("body")
    graph.output(x)
    root = torch.nn.Module()
    root.body = body
    return torch.fx.GraphModule(root, graph)


def _body(fn, *constants: torch.Tensor) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(fn)
    for i, c in enumerate(constants):
        gm.register_buffer(f"c{i}", c)
        with gm.graph.inserting_before(next(iter(gm.graph.nodes)).next):
            gm.graph.get_attr(f"c{i}")
    gm.recompile()
    return gm


def test_a_captured_graph_is_keyed_by_its_code_and_constants():
    key = lambda body: schedule_cache.schedule_key(_with_subgraph(body), "forward", ("target",))
    table = torch.arange(4.0)
    first = key(_body(lambda s: s * 2, table))
    assert first is not None and first == key(_body(lambda s: s * 2, table.clone()))
    assert key(_body(lambda s: s * 3, table)) != first  # other code
    assert key(_body(lambda s: s * 2, table + 1)) != first  # other values captured inside
    unknown = _body(lambda s: s * 2)
    unknown.f = lambda: 0
    with unknown.graph.inserting_before(next(iter(unknown.graph.nodes)).next), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fx warns of an attribute that is no tensor or module)
        unknown.graph.get_attr("f")
    assert key(unknown) is None  # a captured value it cannot describe: not cached


def test_a_flex_attention_schedule_is_cached_and_runs_as_eager(tmp_path):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=32)
    bias = torch.randn(64)

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask, score_mod=lambda s, b, h, qi, ki: s + bias[ki])

    with ember.config.override(cache_dir=str(tmp_path)):
        assert _scheduled(fn, q, k, v)
        assert not _scheduled(fn, q, k, v)
        torch._dynamo.reset()
        with ember.config.override(strict=True, backend="cpp"):
            torch.testing.assert_close(torch.compile(fn, backend="ember")(q, k, v), fn(q, k, v), rtol=1e-5, atol=1e-5)
