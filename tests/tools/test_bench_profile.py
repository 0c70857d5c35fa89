"""`ember bench --profile` on a tiny CPU case: the record, profile.md and ember's explain file; and
the kernel table's GPU branch from made-up profiler events."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from ember.tools.bench import profile
from ember.tools.bench.__main__ import main as bench_main


def test_profile_writes_record_table_and_explain(tmp_path):
    argv = [
        "--profile", "--scale", "tiny", "--device", "cpu", "--workloads", "softmax", "--modes", "inference",
        "--no-inductor", "--cpu-budget-s", "0.02", "--top", "5", "--out", str(tmp_path),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["type"] for r in records] == ["run", "profile"]
    (case,) = records[1:]
    assert case["case"] == "softmax/inference" and case["kernels"] == "CPU ops, by own time"
    assert sorted(case["compilers"]) == ["eager", "ember"], case
    for name, c in case["compilers"].items():
        assert c["status"] == "ok" and c["ms"] > 0, (name, c)
        assert 0 < len(c["top"]) <= 5 and c["kernels_per_call"] > 0, (name, c)
        # the profiler's own step markers are not the program's time
        assert not any(k["name"].startswith("ProfilerStep") for k in c["top"]), c["top"]
        assert "kernel_us" not in c  # kept for the explain file only
    eager_ops = {k["name"] for k in case["compilers"]["eager"]["top"]}
    assert "aten::_softmax" in eager_ops or "aten::amax" in eager_ops, eager_ops
    table = (tmp_path / "profile.md").read_text()
    assert "## softmax/inference" in table and "| eager |" in table and "| ember |" in table, table
    explain = (tmp_path / "explain" / "softmax-inference.txt").read_text()
    assert explain.startswith("inference graph:") and "--- inference host program ---" in explain, explain
    assert "measured k" in explain, explain


def _event(name, us, device_type):
    return SimpleNamespace(name=name, device_time=us, self_cpu_time_total=us, device_type=device_type)


def test_kernel_table_counts_gpu_kernels_per_call():
    """On a GPU only the device's events count (host-side ops are not kernel time), summed by name per call."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [_event("k3", 10.0, cuda), _event("k3", 12.0, cuda), _event("gemm", 40.0, cuda)]
    events += [_event("aten::mm", 500.0, cpu), _event("ProfilerStep#1", 900.0, cpu)]
    table = profile.kernel_table(events, cuda=True, calls=2, top=1)
    assert table["kernels_per_call"] == 1.5 and table["kernels_us_per_call"] == 31.0
    assert table["top"] == [{"name": "gemm", "runs_per_call": 0.5, "us_per_call": 20.0}]
    assert table["kernel_us"] == {"k3": 11.0, "gemm": 20.0}
    on_cpu = profile.kernel_table(events, cuda=False, calls=1, top=5)
    assert [k["name"] for k in on_cpu["top"]] == ["aten::mm"]


def test_markdown_row_of_a_compiler_that_was_not_profiled():
    record = {
        "type": "profile",
        "case": "softmax/inference",
        "shape": "32×64",
        "compilers": {"ember": {"status": "mismatch", "note": "max rel err 1 > tol 1e-4"}},
    }
    text = profile.markdown([record], "# header")
    assert "| ember | mismatch: max rel err 1 > tol 1e-4 |" in text, text


def test_peak_blocks_name_the_program_not_the_bench():
    """An allocation's frames: ember's host program and the model's code, not torch, ember's runtime or the bench."""
    import os

    import ember

    ember_dir = os.path.dirname(ember.__file__)
    frames = [
        {"filename": "<ember host program>", "line": 5, "name": "call"},
        {"filename": os.path.join(ember_dir, "pipeline.py"), "line": 43, "name": "__call__"},
        {"filename": "/env/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
        {"filename": os.path.join(ember_dir, "tools", "bench", "measure.py"), "line": 60, "name": "__call__"},
        {"filename": os.path.join(ember_dir, "tools", "workloads.py"), "line": 31, "name": "softmax_manual"},
        {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"},
    ]
    assert profile._own_frames({"frames": frames}) == [
        "<ember host program>:5 call",
        "tools/workloads.py:31 softmax_manual",
    ]
    memory = {"peak_mb": 2.0, "blocks_alive": 2, "largest": [{"mb": 1.5, "frames": []}]}
    record = {"type": "profile", "case": "c/inference", "shape": "2", "compilers": {"ember": {"memory": memory}}}
    assert "1.500  (no Python frame)" in profile.markdown([record], "# h")
