"""The float64 accuracy rule (ember bench --accuracy) on tiny CPU workloads, and on a planted bug."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ember.ir import ops
from ember.tools.bench import accuracy, float64_rule
from ember.tools.bench.__main__ import main as bench_main
from ember.tools.bench.workloads import select

CPU = torch.device("cpu")


@pytest.mark.parametrize("key", ["softmax/inference", "gpt2_blocks/train"])
def test_tiny_workload_passes_the_float64_rule(key):
    (case,) = select(*key.split("/"))
    record = accuracy.run_case(case, ["ember"], "tiny", CPU)
    assert not record.get("error"), record.get("trace")
    result = record["compilers"]["ember"]
    assert result["status"] == "pass", f"{key}: {result['note']}\n{accuracy.one_line(record)}"
    assert not result["fallbacks"], result["fallbacks"]
    # The output; in training also the input's and every parameter's gradient.
    if case.mode == "inference":
        expected = 1
    else:
        expected = 2 + sum(1 for _ in case.workload.build(case.workload.sizes["tiny"], CPU).fn.parameters())
    assert result["tensors"] == expected, (result["tensors"], expected)


def test_a_planted_bug_fails_the_rule(monkeypatch):
    """exp(x) computed as exp(1.01 x) in C++: softmax's outputs drift, the rule fails it."""
    broken = dataclasses.replace(ops.POINTWISE["exp"], cpp="std::exp({0} * 1.01f)")
    monkeypatch.setitem(ops.POINTWISE, "exp", broken)
    (case,) = select("softmax", "inference")
    record = accuracy.run_case(case, ["ember"], "tiny", CPU)
    result = record["compilers"]["ember"]
    assert result["status"] == "fail", accuracy.one_line(record)
    assert "RMSE" in result["note"], result["note"]


def test_check_tensor_rule():
    ref = torch.linspace(-1, 1, 1000, dtype=torch.float64)
    eager = (ref + 1e-3 * torch.sin(ref * 50)).float()
    assert float64_rule.check_tensor("t", eager.clone(), eager, ref, 1e-4).how == "allclose"
    # Up to twice eager's error plus tol/10 passes; more fails.
    e_err = float64_rule.rmse(eager, ref)
    worse = (ref + 1e-3 * torch.sin(ref * 50) * 1.9).float()
    check = float64_rule.check_tensor("t", worse, eager, ref, 1e-4)
    assert check.passed and check.how == "rmse", check
    much_worse = (ref + 1e-3 * torch.sin(ref * 50) * 3).float()
    check = float64_rule.check_tensor("t", much_worse, eager, ref, 1e-4)
    assert not check.passed and math.isclose(check.bound, 2 * e_err + 1e-5), check
    # bf16 tensors get 3x.
    check = float64_rule.check_tensor("t", much_worse.bfloat16(), eager.bfloat16(), ref, 1e-2)
    assert check.bound == pytest.approx(3 * float64_rule.rmse(eager.bfloat16(), ref) + 1e-3)
    nan = much_worse.clone()
    nan[0] = math.nan
    assert not float64_rule.check_tensor("t", nan, eager, ref, 1e-4).passed


def test_bench_cli_accuracy_mode(tmp_path):
    code = bench_main(
        ["--accuracy", "--no-inductor", "--scale", "tiny", "--workloads", "softmax", "--out", str(tmp_path)]
    )
    assert code == 0
    table = (tmp_path / "accuracy.md").read_text()
    assert "softmax/inference" in table and "| pass |" in table, table
    assert (tmp_path / "results.jsonl").read_text().count('"type": "accuracy"') == 1


def test_cases_left_when_the_budget_is_spent_are_recorded_as_not_run():
    cases = select("softmax,pointwise3", "inference")
    seen = []
    records = accuracy.run(cases, ["ember"], "tiny", CPU, seen.append, deadline=0.0)  # long past
    assert [r["case"] for r in records] == [c.key for c in cases] and seen == records
    assert all(r["skipped"] == "not run: the run's time budget was spent" for r in records)
    assert "not run" in accuracy.markdown(records, "")
