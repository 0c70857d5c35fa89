"""The CPU model group and the bench's CPU peers: ONNX Runtime's step and the freezing pseudo-mode, checked
against eager and the float64 rule at tiny scale. transformers, onnxruntime and onnxscript must be installed
(scripts/test.sh installs them): where one is not, these tests fail naming it."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from ember.tools.bench import accuracy, harness, measure, report
from ember.tools.bench.compilers import compile_fn
from ember.tools.bench.workloads import WORKLOADS, Case, select
from tests.helpers import reports, repro

CPU = torch.device("cpu")
CEILINGS = {"flops": {}, "bandwidth_Bps": 1e10}  # the ceilings only scale the limit column here


def _require(*packages: str) -> None:
    for package in packages:
        try:
            importlib.import_module(package)
        except ImportError as e:
            pytest.fail(f"this test needs {package} (scripts/test.sh installs it): {e}")


def _conv_bn_relu() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, groups=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8))
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    return m.eval()


def test_onnxruntime_step_matches_eager_and_refuses_training():
    _require("onnxruntime", "onnxscript")
    m, x = _conv_bn_relu(), torch.randn(2, 3, 16, 16)
    step = compile_fn(m, "onnxruntime")
    with torch.no_grad():
        torch.testing.assert_close(step(x), m(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step(x + 1), m(x + 1), rtol=1e-5, atol=1e-5)  # the session, reused
    with pytest.raises(NotImplementedError, match="inference only"):
        step(x.requires_grad_())


def test_freezing_pseudo_mode_is_the_default_mode_with_freezing():
    m, x = _conv_bn_relu(), torch.randn(2, 3, 16, 16)
    step = compile_fn(m, "ember:freezing")
    with torch.no_grad(), reports() as report:
        torch.testing.assert_close(step(x), m(x), rtol=1e-5, atol=1e-5)
    (graph,) = [g.aten_graph for g in report.graphs if g.kind == "inference"]
    # frozen, batch norm's rsqrt(var + eps) runs once in the prologue: none of it is left in the compiled graph
    # (the convolution is oneDNN's on a packed weight, frontend/prepack.py)
    assert "mkldnn._convolution_pointwise" in graph and "sqrt" not in graph, graph
    with torch.no_grad():
        m[0].weight.mul_(2)  # a mutated parameter is seen at the next call, never a stale weight
        torch.testing.assert_close(step(x), m(x), rtol=1e-5, atol=1e-5)


def test_cpu_models_group_is_asked_for_by_name():
    group = [w for w in WORKLOADS.values() if w.group == "cpu_models"]
    assert len(group) == 10 and all(w.dtype == "f32" for w in group), [w.name for w in group]
    assert not {c.key for c in select("cpu_models")} & {c.key for c in select("all")}


@pytest.mark.parametrize("name", ["resnet", "mobilenet_v2", "whisper_encoder"])
def test_cpu_model_passes_the_float64_rule_frozen(name):
    _require("transformers")
    record = accuracy.run_case(Case(WORKLOADS[f"cpu_{name}"], "inference"), ["ember:freezing"], "tiny", CPU)
    assert "error" not in record and "skipped" not in record, record.get("error") or record.get("skipped")
    result = record["compilers"]["ember:freezing"]
    assert result["status"] == "pass", f"{accuracy.one_line(record)}  {repro(workload=f'cpu_{name}')}"
    assert not result["fallbacks"], result["fallbacks"]


def test_harness_runs_onnxruntime_beside_ember_in_inference_only():
    _require("transformers", "onnxruntime", "onnxscript")
    settings = harness.Settings(device=CPU, scale="tiny", compilers=["ember", "onnxruntime"], timer=measure.Timer(CPU))
    records = [{"type": "run", "compilers": settings.compilers, "device": "cpu"}]
    for mode in ("inference", "train"):
        records.append(harness.run_case(Case(WORKLOADS["cpu_whisper_encoder"], mode), CEILINGS, settings))
    inference, train = records[1]["compilers"], records[2]["compilers"]
    assert inference["onnxruntime"]["status"] == "ok" and inference["onnxruntime"]["ms"] > 0, inference
    assert train["onnxruntime"] == {"status": "skipped", "note": "runs inference only"}, train
    header, rows, _ = report.table_rows(report.Run.of(records))
    column = header.index("ember ÷ ONNX Runtime")
    assert rows[0][column] != "-" and rows[1][column] == "-", (header, rows)


def test_vision_batch_norms_are_at_a_trained_networks_scale():
    """The vision rows' batch norms have scale 1, shift 0 and the image's own statistics, so that the
    last blocks of a deep net compute on normal floats (transformers' weight-like init of the scales
    left EfficientNet's output subnormal, which Intel CPUs run 10x slower)."""
    _require("transformers")
    (w,) = [w for w in WORKLOADS.values() if w.name == "cpu_efficientnet_b0"]
    built = w.build(w.sizes["tiny"], CPU)
    norms = [m for m in built.fn.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and all(bool((m.weight == 1).all() and (m.bias == 0).all()) for m in norms)
    first = norms[0]
    seen = []
    hook = first.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    built.fn.eval()
    with torch.no_grad():
        out = built.fn(*built.inputs)
    hook.remove()
    batch_mean = seen[0].mean(dim=(0, 2, 3))
    torch.testing.assert_close(first.running_mean, batch_mean, rtol=1e-4, atol=1e-5)
    tiny = torch.finfo(torch.float32).tiny
    assert out.abs().mean() > 1e-3 and not ((out != 0) & (out.abs() < tiny)).any()
