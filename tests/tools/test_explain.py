"""ember.explain: kernel counts for the workloads that must fuse to one kernel, and no fallbacks.

Inference graphs come from running under torch.no_grad(); training graphs (forward and
backward) from inputs that require grad. Both code generators are checked.
"""

from __future__ import annotations

import pytest
import torch

import ember
from ember.tools.workloads import WORKLOADS, softmax_manual
from tests.helpers import BACKENDS, SCALE, assert_close, explain_strict, make_workload, repro

PINNED = [name for name, w in WORKLOADS.items() if w.expected_kernels is not None]


def test_pinned_workloads_are_the_documented_ones():
    assert set(PINNED) == {"pointwise3", "gelu_tanh", "softmax", "layernorm_gelu"}
    assert all(WORKLOADS[n].expected_kernels == 1 for n in PINNED)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", PINNED)
def test_inference_kernel_count(name, backend, tmp_path):
    scale = SCALE[backend]
    fn, inputs = WORKLOADS[name].make(scale, torch.float32, "cpu")
    line = repro(workload=name, backend=backend, scale=scale, dtype=torch.float32, dynamic=False)
    with torch.no_grad(), ember.config.override(cache_dir=str(tmp_path)):  # an empty cache: every pass runs
        report = explain_strict(fn, *inputs, backend=backend)
    assert [g.kind for g in report.graphs] == ["inference"], f"{report}\n{line}"
    (graph,) = report.graphs
    assert graph.fallback is None, f"{graph.fallback}\n{line}"
    assert graph.backend == backend, line
    assert graph.externs == [], f"externs {graph.externs}\n{line}"
    assert len(graph.kernels) == WORKLOADS[name].expected_kernels, f"{report}\n{line}"
    for k in graph.kernels:
        assert k.name and k.name in k.source, f"kernel {k.name} source does not define it\n{line}"
        assert k.ops, f"kernel {k.name} reports no fused ops\n{line}"
    assert graph.compile_seconds > 0, line
    stages = graph.stage_seconds
    passes = ["backend", "import", "cse", "pad", "split", "schedule", "cache write", "build", "host"]
    assert list(stages) == passes, stages
    assert all(s >= 0 for s in stages.values()) and sum(stages.values()) <= graph.compile_seconds, stages
    torch._dynamo.reset()
    with torch.no_grad(), ember.config.override(cache_dir=str(tmp_path)):  # the same graph again: loaded
        (again,) = explain_strict(fn, *inputs, backend=backend).graphs
    assert list(again.stage_seconds) == ["backend", "cached schedule", "build", "host"], again.stage_seconds
    assert [k.source for k in again.kernels] == [k.source for k in graph.kernels], line


def test_kernel_reports_name_the_fused_ops():
    fn, inputs = WORKLOADS["pointwise3"].make("small", torch.float32, "cpu")
    report = explain_strict(fn, *inputs, backend="cpp")
    (kernel,) = report.kernels
    assert {"relu", "mul", "add"} <= set(kernel.ops), kernel.ops
    assert "relu" in str(report) and "1 cpp kernels" in str(report), str(report)


@pytest.mark.parametrize(
    "backend,options",
    [("cpp", {}), ("triton", {}), ("triton", {"persistent_reduction_max": 1024})],
    ids=["cpp", "triton-persistent", "triton-looped"],
)
def test_wide_softmax_is_one_kernel(backend, options):
    """Rows 8192 wide: one kernel whether the row is held whole or looped over in chunks."""
    x = torch.randn(2, 8192)
    line = repro(
        workload="softmax", shape=(2, 8192), backend=backend, options=options, dtype=torch.float32, dynamic=False
    )
    with torch.no_grad():
        report = explain_strict(softmax_manual, x, backend=backend, **options)
        torch._dynamo.reset()
        with ember.config.override(strict=True, backend=backend, **options):
            out = torch.compile(softmax_manual, backend="ember")(x)
    assert len(report.kernels) == 1 and not report.graphs[0].externs, f"{report}\n{line}"
    assert_close(out, softmax_manual(x), rtol=1e-5, atol=1e-7, what="softmax", line=line)


def _no_fallback_cases():
    for backend in BACKENDS:
        for name in WORKLOADS:
            # Training the GPT-2 stack under Triton's interpreter is covered once, in test_end_to_end.
            for train in (False, True):
                if backend == "triton" and name == "gpt2_block" and train:
                    continue
                yield pytest.param(backend, name, train, id=f"{backend}-{name}-{'train' if train else 'infer'}")


@pytest.mark.parametrize("backend,name,train", list(_no_fallback_cases()))
def test_no_fallbacks(backend, name, train):
    """ember compiles every graph of every workload (strict off, so a fallback is reported, not raised)."""
    scale = SCALE[backend]
    fn, inputs = make_workload(name, scale, torch.float32)
    if train:
        inputs = tuple(x.requires_grad_(True) for x in inputs)
    line = repro(workload=name, backend=backend, scale=scale, train=train, dtype=torch.float32, dynamic=False)
    with torch.set_grad_enabled(train), ember.config.override(backend=backend, strict=False):
        report = ember.explain(fn, *inputs)
    kinds = sorted(g.kind for g in report.graphs)
    assert kinds == (["backward", "forward"] if train else ["inference"]), f"{kinds}\n{line}"
    fallbacks = [(g.kind, g.fallback) for g in report.graphs if g.fallback]
    assert not fallbacks, f"fallbacks: {fallbacks}\n{line}"
    assert all(g.kernels for g in report.graphs), f"a graph with no kernels:\n{report}\n{line}"
