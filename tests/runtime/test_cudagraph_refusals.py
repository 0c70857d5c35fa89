"""Why a compiled graph runs without CUDA graphs (ember/runtime/cudagraphs.py: capture_facts, refusals):
host syncs, data-dependent sizes, CPU tensors, ops marked cudagraph_unsafe, explicit generators, host
control flow; each reason is in the graph's report and the log."""

from __future__ import annotations

import io
import logging
import types

import pytest
import torch

from ember import config
from ember.runtime import cudagraphs as cg
from tests.helpers import repro


def _fake(shape, dtype, device):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    return FakeTensor(FakeTensorMode(), torch.empty(shape, dtype=dtype, device="meta"), torch.device(device))


def _host_scalar_graph():
    """A CUDA graph that computes a CPU scalar (DeBERTa's `torch.tensor(d).sqrt()`) and divides by it."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = _fake((4,), torch.float32, "cuda")
    scale = graph.call_function(torch.ops.aten.sqrt.default, (torch.tensor(64.0),))
    scale.meta["val"] = torch.empty(())
    out = graph.call_function(torch.ops.aten.div.Tensor, (x, scale))
    out.meta["val"] = _fake((4,), torch.float32, "cuda")
    graph.output([out])
    return types.SimpleNamespace(graph=graph)


def _aten_graph(target=None, args=(), kwargs=None, cpu_input: bool = False):
    """An ATen graph on a CUDA device: `target(x, *args, **kwargs)`, optionally beside a CPU input."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = FakeTensor(FakeTensorMode(), torch.empty(4, device="meta"), torch.device("cuda"))
    out = [x]
    if cpu_input:
        y = graph.placeholder("y")
        y.meta["val"] = torch.empty(())
    if target is not None:
        out = [graph.call_function(target, (x, *args), kwargs or {})]
    graph.output(out)
    return types.SimpleNamespace(graph=graph)  # what capture_facts reads (a Generator has no source form)


@pytest.mark.parametrize(
    "gm, device, reason",
    [
        pytest.param(lambda: _aten_graph(torch.ops.aten.nonzero.default), "cuda", "data-dependent sizes", id="sizes"),
        pytest.param(
            lambda: _aten_graph(torch.ops.aten.index.Tensor, ([torch.zeros(4, dtype=torch.bool)],)),
            "cuda",
            "data-dependent sizes",
            id="boolean-index",
        ),
        pytest.param(
            lambda: _aten_graph(torch.ops.aten.index.Tensor, ([_fake((3,), torch.long, "cuda")],)),
            "cuda",
            None,
            id="integer-index",
        ),
        pytest.param(
            lambda: _aten_graph(torch.ops.aten.index.Tensor, ([torch.zeros(3, dtype=torch.long)],)),
            "cuda",
            "data-dependent sizes",
            id="host-integer-index",
        ),
        pytest.param(_host_scalar_graph, "cuda", "a CPU tensor computed in the graph (sqrt.default)", id="host-result"),
        pytest.param(lambda: _aten_graph(torch.ops.aten._local_scalar_dense.default), "cuda", "a sync", id="sync"),
        pytest.param(
            lambda: _aten_graph(torch.ops.aten.bernoulli.p, (0.5,), {"generator": torch.Generator()}),
            "cuda",
            "RNG with an explicit generator",
            id="rng",
        ),
        pytest.param(lambda: _aten_graph(torch.ops.aten.bernoulli.p, (0.5,)), "cuda", None, id="rng-default-generator"),
        pytest.param(lambda: _aten_graph(torch.ops.aten.relu.default), "cpu", "runs on cpu", id="cpu-graph"),
        pytest.param(
            lambda: _aten_graph(cpu_input=True), "cuda", "a CPU tensor in the graph (input 1)", id="cpu-input"
        ),
    ],
)
def test_refusal_reasons(gm, device, reason):
    found = cg.refusals(cg.capture_facts(gm(), torch.device(device)), "cuda")
    line = repro(reason=reason, device=device)
    if reason is None:
        assert found == [], line
    else:
        assert len(found) == 1 and reason in found[0], f"{found}\n{line}"


def test_unsafe_op_is_refused():
    lib = torch.library.Library("ember_cudagraphs_test", "DEF")  # noqa: TOR901
    lib.define("unsafe(Tensor x) -> Tensor", tags=[torch.Tag.cudagraph_unsafe])
    found = cg.refusals(
        cg.capture_facts(_aten_graph(torch.ops.ember_cudagraphs_test.unsafe.default), torch.device("cuda")), "cuda"
    )
    assert found == ["ember_cudagraphs_test.unsafe.default is marked cudagraph_unsafe"], repro(op="unsafe")


def test_refusals_are_reported_and_logged():
    """A CPU graph under the real CUDA recorder runs as compiled, and its report and log say why."""
    from ember import explain

    f = lambda x: torch.relu(x) + 1
    x = torch.randn(8)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("ember").addHandler(handler)
    try:
        with config.override(cudagraphs=True, backend="cpp", logs="cudagraphs"):
            report = explain(f, x)
    finally:
        logging.getLogger("ember").removeHandler(handler)
    line = repro(program="relu(x) + 1", device="cpu")
    assert "off: the graph runs on cpu" in report.graphs[0].cudagraphs, f"{report}\n{line}"
    assert "cudagraphs: off" in str(report), line
    assert "runs without CUDA graphs: the graph runs on cpu" in stream.getvalue(), line
    assert cg.refusals(None, "cuda", "NotImplementedError: x") == ["the graph runs eagerly (NotImplementedError: x)"]
