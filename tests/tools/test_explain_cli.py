"""`ember explain script.py --function NAME`: graph breaks with reason and line, graphs, source lines linked
to ops and kernels, layers, and each kernel and extern measured against the measured ceilings."""

from __future__ import annotations

import textwrap

import pytest
import torch

from ember import config
from ember.tools.cli import main as ember_main
from ember.tools.explain import explain_all
from ember.tools.explain_cli import ScriptError, explain_script

SCRIPT = textwrap.dedent(
    """
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 32)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.fc(x))
            return h * 2

    block = Block()

    def breaks(x):
        y = torch.sin(x)
        print("a graph break")
        return torch.cos(y)

    def example_inputs():
        return {"block": (torch.randn(8, 16),), "breaks": (torch.randn(8),)}
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(SCRIPT)
    return path


def test_cli_prints_graphs_lines_and_layers(script, capsys):
    assert ember_main(["explain", str(script), "--function", "block", "--no-measure", "--layers", "all"]) == 0
    out = capsys.readouterr().out
    assert "Dynamo: 1 graph(s), 0 graph break(s)" in out, out[:2000]
    assert "--- Dynamo's FX graph 0 ---" in out and "--- forward ATen graph ---" in out, out[:3000]
    assert "forward graph" in out and "backward graph" in out, out[:2000]
    assert "h = torch.nn.functional.gelu(self.fc(x))" in out and "-> fk" in out, out
    assert "x86 assembly ---" in out and "instructions" in out, out[:3000]


def test_graph_breaks_name_reason_and_line(script):
    e = explain_script(script, "breaks", measure=False)
    assert e.dynamo_graphs == 2, e.breaks
    (brk,) = e.breaks
    assert "print" in brk and f"{script}:17" in brk, brk
    assert [g.kind for g in e.report.graphs] == ["inference", "inference"], e.report


def test_bad_names_are_clear_errors(script, capsys):
    with pytest.raises(ScriptError, match="defines no 'nope'.*block"):
        explain_script(script, "nope")
    assert ember_main(["explain", str(script.parent / "missing.py")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_each_kernel_and_extern_is_timed_against_the_ceilings():
    fc = torch.nn.Linear(16, 64)
    x = torch.randn(32, 16)
    # The linear layer as one addmm extern (ATen's product: ember's C++ GEMM template off)
    with config.override(heuristics="lower.product_bias_as_add=0,cpp.gemm_template=0"):
        e = explain_all(lambda t: torch.relu(fc(t)) * 2, (x,), calls=3, small_ceilings=True)
    assert e.ceilings.bandwidth > 1e8 and e.ceilings.matmul > 1e8, e.ceilings
    kernels = {m.name: m for m in e.measured if m.kind == "kernel"}
    assert set(kernels) == {k.name for k in e.report.kernels}, e.measured
    assert all(m.us > 0 and m.runs == 1 for m in kernels.values()), kernels
    assert all(m.bytes and m.percent_of_roof(e.ceilings) > 0 for m in kernels.values()), kernels
    externs = {m.name: m for m in e.measured if m.kind == "extern"}
    assert {"addmm", "mm"} <= set(externs), e.measured
    assert externs["addmm"].flops == 2 * 32 * 16 * 64 and externs["addmm"].us > 0, externs["addmm"]
    assert fc.weight.grad is None  # explaining does not change the model


def test_a_script_run_whole_shows_its_graphs_and_recompiles(tmp_path, capsys):
    path = tmp_path / "run.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch

            f = torch.compile(lambda x: torch.relu(x) * 2, backend="ember", dynamic=False)
            f(torch.randn(8))
            f(torch.randn(16))
            """
        )
    )
    assert ember_main(["explain", str(path), "--layers", "none"]) == 0
    out = capsys.readouterr().out
    assert out.count("inference graph") == 2, out
    assert "recompile [0/1]" in out and "Dynamo:" in out and "ember:" in out, out


def test_explaining_leaves_buffers_and_random_state_alone():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5))
    x = torch.randn(16, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    explain_all(model, (x,), measure=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
