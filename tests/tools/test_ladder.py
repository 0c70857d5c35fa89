"""`ember ladder` on the CPU at small sizes: every rung of both operations runs, matches float64, and is
put against the measured peak; a rung that computes the wrong thing is reported, not timed; the table
and the plot are written."""

from __future__ import annotations

import json

import torch

from ember.tools.ladder import Rung, _rung, layernorm_gelu_python, layernorm_gelu_torch, main

RUNGS = ["Python loops", "NumPy (BLAS)", "eager PyTorch", "ember"]


def test_cpu_rungs_at_small_sizes(tmp_path, capsys):
    out, png = tmp_path / "ladder.json", tmp_path / "ladder.png"
    assert main(["--size", "small", "--budget", "0.02", "--cpu-only", "--json", str(out), "--plot", str(png)]) == 0
    rungs = [Rung(**r) for r in json.loads(out.read_text())["rungs"]]
    assert [(r.op, r.rung) for r in rungs] == [("matmul", n) for n in RUNGS] + [
        ("layernorm_gelu", n.replace(" (BLAS)", "")) for n in RUNGS
    ]
    assert all(not r.error for r in rungs), [r.error for r in rungs if r.error]
    assert all(r.ms > 0 and r.rate > 0 and r.percent_of_peak > 0 for r in rungs), rungs
    assert {r.unit for r in rungs} == {"GFLOP/s", "GB/s"}
    text = capsys.readouterr().out
    assert "measured peak" in text and all(n in text for n in RUNGS), text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_rung_matches_torch():
    x, w, b = torch.randn(3, 16), torch.randn(16), torch.randn(16)
    got = torch.tensor(layernorm_gelu_python(x.tolist(), w.tolist(), b.tolist()))
    torch.testing.assert_close(got, layernorm_gelu_torch(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_wrong_rung_is_reported_not_timed():
    ref = torch.ones(4, 4, dtype=torch.float64)
    r = _rung("matmul", "broken", torch.device("cpu"), "4^3", lambda: torch.zeros(4, 4), ref, 128, 1e9, 0.01)
    assert r.ms is None and "max error" in r.error, r
