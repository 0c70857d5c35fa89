"""The fuzzer: a few dozen random programs match eager, and a planted bug is caught and reproduced."""

from __future__ import annotations

import dataclasses
import runpy

import pytest
import torch

from ember.ir import ops
from ember.tools import fuzz

CI_SEED, CI_COUNT = 2026, 32


def test_programs_are_reproducible_by_seed():
    a, b = fuzz.generate(5, 11), fuzz.generate(5, 11)
    assert a.source() == b.source() and a.inputs_source() == b.inputs_source()
    assert fuzz.generate(5, 12).source() != a.source()


def test_generator_covers_the_program_space():
    """Over a few hundred programs every op family, dtype and odd shape appears (bookkeeping stays valid)."""
    text = "\n".join(p.source() + p.inputs_source() for p in (fuzz.generate(3, i) for i in range(300)))
    for needle in [
        "torch.matmul", "torch.cat", "torch.where", ".reshape(", ".permute(", ".expand(", ".transpose(-1, -2)",
        "::2]", ".select(", "torch.var(", "torch.amax(", "torch.mean(", "keepdim=True", ".to(torch.bfloat16)",
        "torch.float16", "torch.int64", "(torch.rand(", "torch.softmax", "(0,", ", 0)",
    ]:  # fmt: skip
        assert needle in text, f"no generated program contains {needle!r}"


def test_ci_programs_match_eager(tmp_path):
    summary = fuzz.run(CI_SEED, CI_COUNT, batch=8, repro_dir=tmp_path)
    bad = [f"program {o.program.index} ({o.status}): {o.detail[:500]}" for o in summary.failures]
    assert not bad, "\n".join(bad) + f"\nrepro: python -m ember.tools.fuzz --seed {CI_SEED} --count {CI_COUNT}"
    assert not summary.invalid, [o.detail for o in summary.invalid]
    assert summary.counts.get("ok", 0) >= 0.9 * CI_COUNT, f"too many programs fell back: {summary.counts}"


def test_a_planted_bug_is_caught_and_reproduced(tmp_path, monkeypatch):
    """max rendered as min in C++: the fuzzer reports a mismatch and writes a repro that fails."""
    bad = dataclasses.replace(ops.POINTWISE["maximum"], cpp="ember_minimum({0}, {1})")
    monkeypatch.setitem(ops.POINTWISE, "maximum", bad)
    summary = fuzz.run(7, 16, batch=8, repro_dir=tmp_path)
    assert summary.failures, f"the planted bug went unnoticed: {summary.counts}"
    failing = summary.failures[0]
    assert failing.status == "mismatch", failing.detail
    script = tmp_path / f"repro_seed7_{failing.program.index}.py"
    assert script.exists(), list(tmp_path.iterdir())
    text = script.read_text()
    assert 'backend="ember"' in text and "import ember" not in text
    torch._dynamo.reset()
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(script), run_name="__main__")
    assert info.value.code == 1, "the repro script did not reproduce the mismatch"


def test_compare_rule():
    x = torch.tensor([1.0, 2.0, float("nan"), float("inf")])
    assert fuzz.compare(x.clone(), x, x, 1e-4) is None
    assert fuzz.compare(x + torch.tensor([0, 1e-3, 0, 0]), x, x, 1e-4) is not None
    assert fuzz.compare(torch.tensor([1.0, 2.0, 0.0, float("inf")]), x, x, 1e-4) is not None  # NaN lost
    # Low precision: compiled may differ from eager by eager's own rounding error (against the fp32 reference).
    ref = torch.tensor([1.001, 3.0])
    eager = ref.bfloat16()
    assert fuzz.compare(ref.bfloat16(), eager, ref, 2**-5) is None
    assert fuzz.compare(torch.tensor([1.5, 3.0]).bfloat16(), eager, ref, 2**-5) is not None
    assert fuzz.compare(x.to(torch.float16), x, x, 1e-4) is not None  # dtype
    assert fuzz.compare(torch.tensor([1, 2]), torch.tensor([1, 3]), torch.tensor([1, 3]), 0) is not None


def test_trouble_seen_only_in_a_batch_is_not_dropped():
    """A batch that fails while each of its programs passes alone: every program is reported."""
    progs = [fuzz.generate(1, i) for i in range(4)]

    def fake(programs, options, device="cpu"):
        if len(programs) > 1:
            return None, "mismatch: program 2: output 0 off"
        return [fuzz.Outcome(programs[0], "ok")], ""

    outcomes = fuzz.check(progs, {}, batch_checker=fake)
    assert [o.status for o in outcomes] == ["mismatch"] * 4, outcomes
    assert "only when compiled together" in outcomes[0].detail


def test_gradients_are_checked(monkeypatch):
    """A wrong backward formula (tanh' = 1 - y instead of 1 - y^2) shows as a gradient mismatch."""
    from ember.frontend.decompositions import decomposition_table

    x1 = fuzz.Val("x1", (4, 5), torch.float32)
    prog = fuzz.Program(9, 0, inputs=[(x1, "torch.randn((4, 5), generator=g).to(device)")])
    prog.body, prog.outputs, prog.grad = ["v2 = torch.tanh(x1 * 2)"], [fuzz.Val("v2", (4, 5), torch.float32)], True
    (outcome,) = fuzz.check([prog], {"backend": "cpp"})
    assert outcome.status == "ok", outcome

    # The table AOTAutograd gets, with a wrong entry planted for this test (and removed after it).
    monkeypatch.setitem(decomposition_table(), torch.ops.aten.tanh_backward.default, lambda grad, y: grad * (1 - y))
    torch._dynamo.reset()
    # AOTAutograd's cache keys do not cover the decomposition table: a cached graph would hide the planted entry.
    (outcome,) = fuzz.check([prog], {"backend": "cpp", "aot_cache": False})
    assert outcome.status == "mismatch" and "grad of x1" in outcome.detail, outcome
    assert "output 0" not in outcome.detail, "the forward is right; only the gradient is wrong"
