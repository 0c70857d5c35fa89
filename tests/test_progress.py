"""Progress of long compiles (ember/progress.py): silent when quick, then which graph, which stage,
how many kernels. The decisions run on a fake clock; one compile checks the hooks end to end."""

from __future__ import annotations

import io

import torch

from ember import config, progress
from ember.progress import CompileProgress
from tests.helpers import assert_close


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _reporter(live: bool):
    clock, lines = FakeClock(), []
    p = CompileProgress("graph 0/0 (12 ops)", lambda line, final: lines.append((line, final)), live, clock, after_s=2.0)
    return p, clock, lines


def test_a_quick_compile_prints_nothing():
    p, clock, lines = _reporter(live=False)
    for stage in ("forward: scheduling", "forward: building 3 kernels", "AOTAutograd"):
        clock.now += 0.6
        p.enter(stage)
        p.tick()
    p.kernels_built("forward", 3)
    p.finish()
    assert lines == []


def test_a_long_compile_names_graph_stage_and_kernels():
    p, clock, lines = _reporter(live=False)
    p.enter("forward: scheduling")
    clock.now += 2.5
    p.tick()  # past the mark: where the compile is
    p.tick()  # the same stage again: not repeated on a plain stream
    clock.now += 1.0
    p.enter("forward: building 41 kernels")
    p.kernels_built("forward", 41)
    clock.now += 10.0
    p.tick()
    p.finish()
    assert lines == [
        ("graph 0/0 (12 ops): forward: scheduling, 2 s", False),
        ("graph 0/0 (12 ops): forward: building 41 kernels, 4 s", False),
        ("graph 0/0 (12 ops): compiled in 14 s (forward: 41 kernels)", True),
    ]


def test_a_compile_that_raises_says_it_stopped():
    """A Dynamo restart (or strict mode's error) ends the compile: not "compiled"."""
    p, clock, lines = _reporter(live=False)
    clock.now += 7.0
    p.tick()
    p.finish(error=RuntimeError("restart"))
    assert lines[-1] == ("graph 0/0 (12 ops): stopped after 7 s (RuntimeError)", True)


def test_on_a_terminal_the_seconds_count_up_within_a_stage():
    p, clock, lines = _reporter(live=True)
    p.enter("backward: building 58 kernels")
    for _ in range(3):
        clock.now += 1.5
        p.tick()
    assert [line for line, _ in lines] == [
        "graph 0/0 (12 ops): backward: building 58 kernels, 3 s",
        "graph 0/0 (12 ops): backward: building 58 kernels, 4 s",
    ]


class _Stream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_setting_and_terminal_decide_who_reports(monkeypatch):
    monkeypatch.setattr("sys.stderr", _Stream(terminal=False))
    assert progress._reporter("g") is None  # auto, and stderr is not a terminal
    with config.override(progress="on"):
        assert progress._reporter("g") is not None
    monkeypatch.setattr("sys.stderr", _Stream(terminal=True))
    assert progress._reporter("g").live
    with config.override(progress="off"):
        assert progress._reporter("g") is None


def test_a_compile_reports_its_stages(monkeypatch):
    """With the mark at 0 s, a training compile reports each graph's stages and kernels."""
    stream = _Stream(terminal=False)
    monkeypatch.setattr("sys.stderr", stream)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    compiled = torch.compile(model, backend="ember", options={"progress": "on", "progress_after_s": 0, "strict": True})
    out = compiled(x)
    assert_close(out, model(x), rtol=1e-5, atol=1e-6, what="output", line="progress=on, Linear-GELU-Linear")
    lines = stream.getvalue().splitlines()
    assert lines and all(line.startswith("[ember] graph 0/0 (3 ops): ") for line in lines), lines
    assert any("forward: scheduling" in line for line in lines), lines
    assert any("forward: building" in line for line in lines), lines
    assert any("backward: building" in line for line in lines), lines
    assert lines[-1].startswith("[ember] graph 0/0 (3 ops): compiled in"), lines
    assert "forward: " in lines[-1] and "backward: " in lines[-1], lines
