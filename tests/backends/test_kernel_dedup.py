"""Each distinct Triton kernel is compiled once per process (backends/kernel_dedup.py): kernels equal
up to their names share the first one's compiled form across the layers of a graph, across graphs,
and between the forward and the backward; results stay eager's. Under Triton's interpreter nothing
compiles, and kernels of one key share one function: what `ember.stats` counts."""

from __future__ import annotations

import torch

import ember
from ember import stats
from ember.backends.kernel_dedup import kernel_key, normalized
from tests.helpers import assert_no_fallback, reports

SOURCE = """@triton.jit
def fk3(in_v2, out_v8, xnumel, XBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    tmp1 = tl.load(in_v2 + xindex, xindex < xnumel, other=0)
    tl.store(out_v8 + xindex, tmp1 * 2.0, xindex < xnumel)
"""


def test_sources_equal_up_to_names_have_one_key_and_other_code_another():
    renamed = SOURCE.replace("fk3", "bk17").replace("in_v2", "in_v40").replace("out_v8", "out_v9")
    assert normalized(renamed) == normalized(SOURCE)
    assert "fk3" not in normalized(SOURCE) and "in_v2" not in normalized(SOURCE)
    spec = ((torch.float32, torch.float32, 64), {"XBLOCK": 64}, 4, True)
    assert kernel_key(renamed, spec, ()) == kernel_key(SOURCE, spec, ())
    assert kernel_key(SOURCE.replace("2.0", "3.0"), spec, ()) != kernel_key(SOURCE, spec, ())
    other_spec = ((torch.float16, torch.float32, 64), {"XBLOCK": 64}, 4, True)
    assert kernel_key(SOURCE, other_spec, ()) != kernel_key(SOURCE, spec, ())


def _run(fn, *inputs, train=True):
    with reports() as report, ember.config.override(backend="triton", strict=True):
        before = stats.snapshot()
        out = torch.compile(fn, backend="ember")(*inputs)
        if train:
            out.sum().backward()
        counted = stats.delta(before)
    assert_no_fallback(report, "dedup")
    return out, report, counted


def test_the_backward_reuses_the_forwards_kernel():
    w = torch.randn(11, 7)
    x = torch.randn(11, 7, requires_grad=True)
    out, report, counted = _run(lambda a: a * w, x)  # the backward's grad * w is the forward's kernel
    assert [g.kind for g in report.graphs] == ["forward", "backward"]
    assert counted.get("kernels_compiled") == 1 and counted.get("kernel_dedup_hits") == 1, counted
    ref = x.detach().clone().requires_grad_()
    torch.testing.assert_close(out, ref * w)
    (ref * w).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_identical_layers_and_another_graph_compile_each_kernel_once():
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(13, 13), torch.nn.LayerNorm(13), torch.nn.GELU()) for _ in range(3)]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(5, 13, requires_grad=True)
    out, report, counted = _run(model, x)
    kernels = sum(len(g.kernels) for g in report.graphs)
    # One layer's kernels compile; the two others (forward and backward) take them.
    assert counted.get("kernels_compiled", 0) * 2 < kernels, (counted, kernels)
    assert counted["kernels_compiled"] + counted["kernel_dedup_hits"] == kernels
    ref_x = x.detach().clone().requires_grad_()
    ref = model(ref_x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    # Another graph of the same layers (inference, two of them): its layers' kernels are found.
    again = torch.nn.Sequential(*layers[:2])
    with torch.no_grad():
        out2, report2, counted2 = _run(again, x.detach(), train=False)
    assert counted2["kernel_dedup_hits"] >= 1, counted2
    assert counted2.get("kernels_compiled", 0) + counted2["kernel_dedup_hits"] == len(report2.graphs[0].kernels)
    with torch.no_grad():
        torch.testing.assert_close(out2, again(x.detach()), rtol=1e-5, atol=1e-5)
