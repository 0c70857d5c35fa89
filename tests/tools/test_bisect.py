"""ember bisect names the op whose lowering is wrong, and writes a repro that shows it."""

from __future__ import annotations

import dataclasses
import runpy

import pytest
import torch

from ember import config
from ember.ir import ops
from ember.tools.bisect import bisect


def _program(x, y):
    a = torch.relu(x + y) * 0.5
    b = torch.sigmoid(a) - x
    c = torch.exp(b)
    return (c * 3).sum(1) + torch.tanh(a).mean()


def test_bisect_names_a_broken_lowering(tmp_path, monkeypatch):
    """exp rendered as exp(-x) in C++: bisect reports aten.exp as an op bug; the repro fails with it."""
    broken = dataclasses.replace(ops.POINTWISE["exp"], cpp="std::exp(-{0})")
    monkeypatch.setitem(ops.POINTWISE, "exp", broken)
    x, y = torch.randn(5, 7), torch.randn(7)
    result = bisect(_program, [x, y], out=tmp_path, options={"cache_dir": str(tmp_path / "cache")})
    assert result.op == "exp", str(result)
    assert result.kind == "op", str(result)
    assert "aten.exp" in result.culprit, str(result)
    assert result.repro is not None and result.repro.exists(), str(result)
    text = result.repro.read_text()
    assert "torch.ops.aten.exp" in text and 'backend="ember"' in text, text
    assert "tanh" not in text, "the repro should hold only the culprit and what it depends on"
    torch._dynamo.reset()
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(result.repro), run_name="__main__")
    assert info.value.code == 1, "the repro did not reproduce the mismatch"


def test_bisect_reports_no_mismatch_for_a_correct_program(tmp_path):
    result = bisect(_program, [torch.randn(4, 6), torch.randn(6)], options={"cache_dir": str(tmp_path)})
    assert result.kind == "no mismatch" and result.culprit is None, str(result)
    assert len(result.trials) == 1


def test_bisect_ops_setting_limits_lowering():
    """bisect_ops=N lowers N ops per graph, runs the rest as ATen externs; the result stays right."""
    from ember.report import collecting

    x, y = torch.randn(5, 7), torch.randn(7)
    counts = {}
    for limit in (0, 2, -1):
        torch._dynamo.reset()
        with config.override(bisect_ops=limit, strict=True, backend="cpp"), collecting() as report:
            out = torch.compile(_program, backend="ember")(x, y)
        torch.testing.assert_close(out, _program(x, y))
        (graph,) = report.graphs
        counts[limit] = len(graph.externs)
    assert counts[0] > counts[2] > counts[-1], counts
    assert "bisect_ops" in config.codegen_key(), "bisect_ops changes the generated code: it must enter cache keys"


def test_bisect_names_an_op_whose_code_does_not_compile(tmp_path, monkeypatch):
    """tanh rendered as C++ that g++ rejects: the compile raises (strict); bisect names aten.tanh."""
    broken = dataclasses.replace(ops.POINTWISE["tanh"], cpp="no_such_function({0})")
    monkeypatch.setitem(ops.POINTWISE, "tanh", broken)
    x, y = torch.randn(5, 7), torch.randn(7)
    result = bisect(_program, [x, y], out=tmp_path, options={"cache_dir": str(tmp_path / "cache")})
    assert result.op == "tanh" and result.kind == "op", str(result)
    assert "no_such_function" in result.detail or "ToolchainError" in result.detail, result.detail
    assert result.repro is not None and "torch.ops.aten.tanh" in result.repro.read_text()


def test_bisect_checks_gradients_and_blames_a_wrong_decomposition(tmp_path, monkeypatch):
    """tanh's backward decomposed as grad * (1 - y): the forward matches, the gradients do not, and
    they stay wrong with no op lowered (every op an ATen call), so bisect blames the graph itself."""
    from ember.frontend.decompositions import decomposition_table

    # The table AOTAutograd gets, with a wrong entry planted for this test (and removed after it).
    monkeypatch.setitem(decomposition_table(), torch.ops.aten.tanh_backward.default, lambda grad, y: grad * (1 - y))
    x, y = torch.randn(5, 7, requires_grad=True), torch.randn(7, requires_grad=True)
    # AOTAutograd's cache keys do not cover the decomposition table: a cached graph would hide the planted entry.
    options = {"cache_dir": str(tmp_path / "cache"), "aot_cache": False}
    result = bisect(_program, [x, y], out=tmp_path, options=options)
    assert result.kind == "eager graph" and "decompositions" in result.detail, str(result)
    assert "output 0" not in result.detail, f"the forward output is right, only gradients differ: {result}"
