"""`ember profile`: a step's time split into GEMM/attention, fused kernels, copies, communication, host gaps
and idle, with the top kernels and a verdict; on the CPU for a small model, and the GPU split on a
synthetic trace (kernels, gaps, a synchronization)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ember.tools.profile_step import CATEGORIES, main, profile_workload, split_gpu, verdict


@pytest.mark.parametrize(
    ("workload", "mode", "compiler"),
    [("linear_bias_gelu", "inference", "ember"), ("gpt2_blocks", "train", "eager")],
)
def test_cpu_profile_of_a_step(workload, mode, compiler):
    p = profile_workload(workload, mode, compiler, scale="tiny", calls=2)
    assert list(p.split_ms) == list(CATEGORIES)
    assert p.split_ms["GEMM/attention"] > 0 and p.split_ms["fused kernels"] > 0, p.table()
    assert p.split_ms["idle"] == 0  # the CPU has no device to wait for
    total = sum(p.split_ms.values())
    assert 0.9 * p.step_ms <= total <= 1.1 * p.step_ms, p.table()
    assert any("mm" in k["name"] for k in p.top), p.top
    assert p.verdict.startswith(("healthy", "overhead-bound")), p.verdict


def test_cli_prints_the_split_and_verdict(capsys, tmp_path):
    assert main(["tiny_mlp_b1", "--mode", "inference", "--scale", "tiny", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    assert "launch overhead" in out and "verdict: " in out, out
    written = tmp_path / "profile.json"
    args = ["tiny_mlp_b1", "--mode", "inference", "--scale", "tiny", "--calls", "2", "--top", "3", "--json"]
    assert main([*args, str(written)]) == 0
    assert len(json.loads(written.read_text())["top"]) == 3
    assert main(["no_such_model"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def _event(name, start, end, cuda):
    device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_gpu_split_of_a_synthetic_trace():
    events = [
        _event("sm90_xmma_gemm_bf16", 0, 30, True),
        _event("flex_fwd", 30, 40, True),  # ember's FlexAttention kernel: attention
        _event("fk3", 45, 55, True),  # 5 µs gap before: the host was launching
        _event("Memcpy DtoD (Device -> Device)", 55, 60, True),
        _event("ncclDevKernel_AllReduce_Sum_f32", 60, 70, True),
        _event("cudaStreamSynchronize", 72, 90, False),  # the device idles from 70 to 90 in it
        _event("bk0", 90, 100, True),
    ]
    split, busy = split_gpu(events, [(0, 100)])
    assert split == {
        "GEMM/attention": 40,
        "fused kernels": 20,
        "memory copies": 5,
        "communication": 10,
        "launch overhead": 7,  # 40-45 and 70-72
        "idle": 18,
    }
    assert busy == 75


def test_verdicts():
    busy = dict.fromkeys(CATEGORIES, 0.0) | {"GEMM/attention": 0.8, "fused kernels": 0.15, "launch overhead": 0.05}
    assert verdict(busy, 1.0, 0.95, 20).startswith("healthy")
    gaps = dict.fromkeys(CATEGORIES, 0.0) | {"fused kernels": 0.3, "launch overhead": 0.7}
    v = verdict(gaps, 1.0, 0.3, 100)
    assert v.startswith("overhead-bound") and "70%" in v, v


def test_host_profile_charges_each_layer(capsys, tmp_path):
    """`--host`: the step's own time by layer; ember's generated host program and runtime are charged
    to ember, Dynamo's frame wrapper to Dynamo, the matrix products to builtins."""
    out_json = tmp_path / "host.json"
    assert (
        main(
            ["tiny_mlp_b1", "--mode", "inference", "--scale", "tiny", "--host", "--calls", "5", "--json", str(out_json)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "own time by layer" in out, out
    import json

    layers = json.loads(out_json.read_text())["layers_us"]
    assert layers["ember"] > 0 and layers["Dynamo"] > 0 and layers["builtins"] > 0, layers


def test_layer_of_files():
    from ember.tools.host_profile import layer_of

    assert layer_of("<ember host program>") == "ember"
    assert layer_of("/x/site-packages/torch/_dynamo/eval_frame.py") == "Dynamo"
    assert layer_of("/x/site-packages/torch/_functorch/_aot_autograd/runtime_wrappers.py") == "AOTAutograd"
    assert layer_of("/x/site-packages/triton/backends/nvidia/driver.py") == "Triton"
    assert layer_of("/x/site-packages/torch/nn/modules/module.py") == "other torch"
    assert layer_of("~") == "builtins"


def test_layer_of_installed_libraries_under_a_folder_named_ember():
    """A virtual environment inside a checkout named `ember` still charges torch to torch."""
    from ember.tools.host_profile import layer_of

    venv = "/home/u/ember/.venv/lib/python3.12/site-packages/"
    assert layer_of(venv + "torch/nn/modules/module.py") == "other torch"
    assert layer_of(venv + "triton/runtime/jit.py") == "Triton"
    assert layer_of("/home/u/ember/train.py") == "other Python"
