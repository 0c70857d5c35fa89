"""The OpInfo sweep's fast CI subset: a fixed list of diverse ops, every outcome a match or a clean fallback.

The full sweep (`ember opinfo`, docs/opinfo/) runs on demand; this subset covers lowered pointwise
ops in each dtype family, reductions, views, decomposed composites with gradients, and externs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember.tools import opinfo

# (op name as `ember opinfo --ops` spells it, dtype): a fixed, diverse list; 4 samples each.
SUBSET = [
    ("add", torch.float32),  # lowered arithmetic, with gradients
    ("mul", torch.int64),
    ("div.no_rounding_mode", torch.bfloat16),  # low precision against the float32 reference
    ("where", torch.float16),
    ("logical_and", torch.bool),
    ("clamp", torch.float32),
    ("nn.functional.gelu", torch.float32),  # a decomposed composite, forward and backward
    ("softmax", torch.bfloat16),  # a reduction fused with its epilogue
    ("sum", torch.int64),
    ("var", torch.float32),
    ("amax", torch.float16),
    ("permute", torch.float32),  # views
    ("broadcast_to", torch.bool),
    ("cat", torch.float32),  # selections among clamped views
    ("nn.functional.pad.constant", torch.float32),
    ("matmul", torch.float32),  # an extern
]
LIMIT = 4


def _op(name: str):
    (op,) = [o for o in opinfo.select_ops([name]) if opinfo.op_name(o) == name]
    return op


@pytest.mark.parametrize("name,dtype", SUBSET, ids=[f"{n}-{opinfo.dtype_name(d)}" for n, d in SUBSET])
def test_opinfo_subset(name, dtype):
    op = _op(name)
    assert dtype in op.supported_dtypes("cpu"), f"{name} does not support {dtype}: the subset list is stale"
    r = opinfo.sweep_pair(op, dtype, "cpu", limit=LIMIT, timeout_s=240)
    bad = [d for d in r["details"] if d["outcome"] in ("mismatch", "crash", "timeout")]
    line = f"repro: python -m ember.tools.opinfo --ops {name} --dtypes {opinfo.dtype_name(dtype)} --limit {LIMIT}"
    assert not bad, f"{name} {dtype}: {bad}\n{line}"
    assert r["counts"]["match"] >= 1, f"{name} {dtype}: no sample matched: {r}\n{line}"


def test_compare_rule():
    """The comparison: exact for ints, assert_close first, then the higher-precision reference rule."""
    x = torch.tensor([1.0, 2.0, float("nan")])
    assert opinfo.compare(x, x.clone()) is None  # NaN equals NaN
    assert opinfo.compare(torch.tensor([1, 2]), torch.tensor([1, 3])) is not None
    assert "dtype" in opinfo.compare(x.half(), x)
    # bfloat16: compiled (rounded once) is closer to the float32 reference than eager (rounded twice).
    ref = torch.tensor([1.0 / 3.0, 2.0 / 3.0])
    eager = (ref.bfloat16() + 0.02).bfloat16()
    compiled = ref.bfloat16()
    assert opinfo.compare(compiled, eager, lambda: ref, torch.bfloat16) is None
    # ... but a compiled result far from the reference is a mismatch.
    assert opinfo.compare((ref + 0.5).bfloat16(), eager, lambda: ref, torch.bfloat16) is not None


def test_a_batch_dynamo_runs_eagerly_does_not_settle_samples_that_compile_alone():
    # __getitem__'s boolean-mask sample breaks the batch's graph and Dynamo ran the whole batch eagerly;
    # the no-graph shortcut then counted all 16 samples as fallbacks without running any alone.
    samples = opinfo.run_pair(_op("__getitem__"), torch.bfloat16, "cpu", limit=None, grad_dtypes=())
    outcomes = [s.outcome for s in samples]
    assert set(outcomes) <= {"match", "fallback"}, [(s.index, s.outcome, s.reason) for s in samples]
    assert outcomes.count("match") >= len(samples) - 2, [(s.index, s.outcome, s.reason) for s in samples]


def test_sweep_writes_under_the_current_directory_not_the_checkout(tmp_path, monkeypatch):
    """Without --out the tables go to ./results/opinfo; the checkout's committed docs/opinfo is untouched."""
    committed = Path(__file__).resolve().parents[2] / "docs" / "opinfo"
    before = {p.name: p.read_bytes() for p in committed.iterdir() if p.is_file()}
    monkeypatch.chdir(tmp_path)
    assert opinfo.main(["--ops", "abs", "--dtypes", "float32", "--limit", "1", "--in-process"]) == 0
    written = tmp_path / "results" / "opinfo"
    records = opinfo.load_records(written / "cpu.jsonl")
    assert list(records) == [("abs", "float32")] and records["abs", "float32"]["counts"]["match"] == 1
    assert "abs" in (written / "cpu.md").read_text()
    assert {p.name: p.read_bytes() for p in committed.iterdir() if p.is_file()} == before


def test_report_sections():
    """The markdown report from hand-made records: totals, a dtype row, a fallback reason, a mismatch
    listed with its reason, a random op, and the per-op cells (counts, `!N`, no samples)."""
    from ember.tools.opinfo.report import render_markdown

    def record(op, dtype, counts, details=(), **extra):
        full = dict.fromkeys(("match", "fallback", "mismatch", "crash", "timeout", "skipped"), 0) | counts
        return {
            "op": op,
            "dtype": dtype,
            "counts": full,
            "details": list(details),
            "samples": sum(counts.values()),
        } | extra

    records = [
        record(
            "abs",
            "float32",
            {"match": 3, "fallback": 1},
            [{"i": 3, "outcome": "fallback", "reason": "forward: no | lowering"}],
        ),
        record("abs", "bfloat16", {"match": 1, "mismatch": 1}, [{"i": 1, "outcome": "mismatch", "reason": "off by 1"}]),
        record("rand_like", "float32", {"match": 2}, random=True),
        record("empty_op", "int64", {}, note="no samples for int64"),
    ]
    text = render_markdown(records, "cpu", "ember opinfo --ops abs")
    assert "Command: `ember opinfo --ops abs`" in text and "3 ops, 4 (op, dtype) pairs." in text
    assert "| 8 | 6 | 1 | 1 | 0 | 0 | 87.50% | 0 |" in text, text  # 8 counted, 7 matched or fell back
    assert "| float32 | 2 | 5 | 1 | 0 | 0 | 0 | 0 |" in text, text
    assert "| 1 | no \\| lowering |" in text, text  # the graph kind dropped, the pipe escaped
    assert "| abs | bfloat16 | 1 | mismatch | off by 1 |" in text, text
    assert "`rand_like`" in text.split("## Compared by shape and dtype only")[1].split("##")[0]
    per_op = text.split("## Per op")[1]
    assert "| `abs` | 3/1/0 | 1/0/0 **!1** |" in per_op, per_op
    assert "no samples" in per_op.split("`empty_op`")[1].splitlines()[0], per_op


# In-place variants (`ember opinfo --inplace`): the sample's own input is written; (op, dtype), 2 samples each.
INPLACE_SUBSET = [("index_put", torch.float32), ("scatter", torch.int64), ("lerp", torch.bfloat16)]


def _inplace_op(name: str):
    (op,) = [o for o in opinfo.select_ops([name], inplace=True) if o.op.name == name and not o.variant_test_name]
    return op


@pytest.mark.parametrize("name,dtype", INPLACE_SUBSET, ids=[f"{n}_-{opinfo.dtype_name(d)}" for n, d in INPLACE_SUBSET])
def test_opinfo_inplace_subset(name, dtype):
    op = _inplace_op(name)
    r = opinfo.sweep_pair(op, dtype, "cpu", limit=2, timeout_s=240)
    line = f"repro: python -m ember.tools.opinfo --inplace --ops {name} --dtypes {opinfo.dtype_name(dtype)} --limit 2"
    assert r["op"] == f"{name}_", f"{r['op']}\n{line}"
    bad = [d for d in r["details"] if d["outcome"] in ("mismatch", "crash", "timeout")]
    assert not bad and r["counts"]["match"] >= 1, f"{name}_ {dtype}: {r}\n{line}"


def test_inplace_variant_returns_the_written_input():
    """A call gives (result, the input after it, whether they are one object): what the sweep compares."""
    op = _inplace_op("add")
    x, y = torch.zeros(3), torch.ones(3)
    result, after, same = op.settle(op(x, y))
    assert same and after is x and torch.equal(x, torch.ones(3)), (result, after, same)


def test_inplace_sample_dynamo_refuses_is_skipped_not_a_crash():
    # Eager's addbmm_ resizes a one-element input to the product's shape; Dynamo's fake tensors refuse
    # it with every backend, so no backend ever sees the sample: skipped, not an ember crash.
    samples = opinfo.run_pair(_inplace_op("addbmm"), torch.float32, "cpu", limit=None, grad_dtypes=())
    outcomes = {(s.outcome, s.reason.split(":")[0]) for s in samples}
    assert all(o in ("match", "skipped") for o, _ in outcomes), [(s.index, s.outcome, s.reason) for s in samples]
    assert ("skipped", "torch.compile raises with backend='eager' too") in outcomes, outcomes
