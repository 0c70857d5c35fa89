"""Launch tuning (backends/launch_tuning.py, codegen/triton_tuning.py) on the CPU: the candidates the
target's heuristics give, the choice by a fake timer, the budget, the disk cache and its key, and a
compile under mode='max-autotune-no-cudagraphs' through Triton's interpreter, checked against eager."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ember import config
from ember.backends.launch_tuning import Budget, choose, tune_launches, tuning_key
from ember.backends.triton import TritonBackend
from ember.codegen.triton import render_triton
from ember.codegen.triton_launch import launch_config
from ember.codegen.triton_tuning import launch_candidates
from ember.frontend.backend import _checked_options
from ember.ir.sizes import index_symbol
from ember.runtime.cache import DiskCache
from tests.schedule.test_fusion import TRITON, G


class FakeTimer:
    """Times from a table by candidate (each run is `lambda: name`), and a clock each timing advances."""

    def __init__(self, seconds: dict[str, float], cost: float = 1.0):
        self.seconds, self.cost, self.now, self.timed = seconds, cost, 0.0, []

    def clock(self) -> float:
        return self.now

    def time(self, run) -> float:
        name = run()
        self.timed.append(name)
        self.now += self.cost
        return self.seconds[name]


def _runs(*names):
    return lambda: [None if n is None else (lambda n=n: n) for n in names]


def _softmax_kernel(rows=4096, cols=1024):
    b = G()
    x = b.input(rows, cols)
    m = b.reduce("max", x, (1,), keepdim=True)
    e = b.pw("exp", b.pw("sub", x, m))
    (k,) = b.schedule(b.pw("truediv", e, b.reduce("sum", e, (1,), keepdim=True))).kernels
    return k


def test_candidates_are_the_heuristics_choice_then_its_neighbours():
    k = _softmax_kernel()
    base = launch_config(k, TRITON)
    cands = launch_candidates(k, TRITON)
    assert cands[0] == base and 2 <= len(cands) <= TRITON.heuristics.tune.max_candidates
    assert len(set(map(str, cands))) == len(cands)
    for c in cands[1:]:  # one number changed, by a factor of two; a row held whole keeps its RBLOCK
        changed = [f.name for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(base, f.name)]
        assert len(changed) == 1 and changed[0] in ("xblock", "num_warps"), (c, base)
        assert c.rblock == base.rblock and c.persistent

    # 256 rows of 1024: the heuristic's row a program makes 256 programs; two rows would make 128,
    # fewer than an H100's 132 SMs, which is no candidate there, but is on a GPU of 8 SMs.
    k256 = _softmax_kernel(256, 1024)
    assert launch_config(k256, TRITON).xblock == 1
    assert 2 not in [c.xblock for c in launch_candidates(k256, TRITON)]
    assert 2 in [c.xblock for c in launch_candidates(k256, dataclasses.replace(TRITON, sm_count=8))]
    fewer = dataclasses.replace(TRITON, heuristics=TRITON.heuristics.tuned("tune.max_candidates=2"))
    assert launch_candidates(k, fewer) == cands[:2]
    # A row walked in chunks: its step and its loop's pipelining stages vary too.
    looped = launch_candidates(_softmax_kernel(64, 1 << 16), TRITON)
    assert any(c.rblock != looped[0].rblock for c in looped) and any(c.loop_stages for c in looped)
    # Symbolic sizes: nothing to measure at, the heuristic's choice alone.
    b = G()
    (k,) = b.schedule(b.pw("exp", b.input(index_symbol("s0"), 64))).kernels
    assert launch_candidates(k, TRITON) == [launch_config(k, TRITON)]


def test_the_fastest_candidate_wins_by_a_margin(tmp_path):
    with config.override(cache_dir=str(tmp_path)):
        timer = FakeTimer({"a": 10.0, "b": 7.0, "c": 9.0, "d": 9.9})
        best, timings = choose("k-fastest", "abc", _runs("a", "b", "c"), timer, Budget(0, 100, 0), 2)
        assert best == 1 and timings["seconds"] == [10.0, 7.0, 9.0]
        # Within the margin of the heuristic's time (2%): the heuristic stays.
        assert choose("k-margin", "ad", _runs("a", "d"), FakeTimer(timer.seconds), Budget(0, 100, 0), 2)[0] == 0
        # A candidate that was dropped (None: did not compile, or gave another result) is not timed.
        timer = FakeTimer(timer.seconds)
        assert choose("k-dropped", "abc", _runs("a", None, "c"), timer, Budget(0, 100, 0), 2)[0] == 2
        assert timer.timed == ["a", "c"]


def test_the_budget_bounds_what_is_measured(tmp_path):
    def never():
        raise AssertionError("no budget left: nothing is compiled")

    with config.override(cache_dir=str(tmp_path)):
        timer = FakeTimer({"a": 2.0, "b": 1.0}, cost=3.0)
        budget = Budget(0.0, 5.0, timer.clock())
        assert choose("k-budget-1", "ab", _runs("a", "b"), timer, budget, 2)[0] == 1  # started within: finished
        assert budget.left(timer) < 0 and budget.spent == 6.0 and budget.spent_on == ["k-budget-1"]
        assert choose("k-budget-2", "ab", never, timer, budget, 2) == (0, None)
        # The settings' budget: a fraction of the compile's own time so far (tuning excluded), at
        # least autotune_min_s; it grows as the compile goes on.
        with config.override(autotune_budget=0.1, autotune_min_s=0.5):
            budget = Budget.from_settings(timer, 30.0)
            assert budget.left(timer) == pytest.approx(3.0)
            assert Budget.from_settings(timer, 1.0).left(timer) == 0.5
            budget.charge(2.0, "x")
            timer.now += 2.0  # tuning's own two seconds: the compile's time is still 30 s
            assert budget.left(timer) == pytest.approx(1.0)
            timer.now += 20.0  # 20 s more of the compile's own
            assert budget.left(timer) == pytest.approx(3.0)


def test_timings_are_kept_on_disk_and_read_back(tmp_path):
    def never():
        raise AssertionError("cached: nothing is measured")

    with config.override(cache_dir=str(tmp_path)):
        choose("k-disk", "ab", _runs("a", "b"), FakeTimer({"a": 2.0, "b": 1.0}), Budget(0, 100, 0), 2)
        entry = DiskCache().get("tuning", "k-disk")
        assert json.loads(entry["timings.json"])["seconds"] == [2.0, 1.0]
        # Written by another process: read from the disk, with no budget left and nothing measured.
        DiskCache().put("tuning", "k-other", {"timings.json": json.dumps({"seconds": [3.0, None, 1.0]}).encode()})
        assert choose("k-other", "abc", never, FakeTimer({}), Budget(0, 0, 0), 2)[0] == 2
    with config.override(cache_dir=str(tmp_path), cache=False):
        choose("k-off", "ab", _runs("a", "b"), FakeTimer({"a": 2.0, "b": 1.0}), Budget(0, 100, 0), 2)
    with config.override(cache_dir=str(tmp_path)):
        assert DiskCache().get("tuning", "k-off") is None


def test_the_key_names_the_device_its_sm_count_and_the_kernel_not_its_name():
    k = _softmax_kernel()
    cands = launch_candidates(k, TRITON)
    key = tuning_key(k, render_triton(k, TRITON), cands, TRITON)
    renamed = dataclasses.replace(k, name="other_name") if dataclasses.is_dataclass(k) else None
    if renamed is not None:
        assert tuning_key(renamed, render_triton(renamed, TRITON), cands, TRITON) == key
    for other in ({"device_name": "NVIDIA H200"}, {"sm_count": 114}):
        t = dataclasses.replace(TRITON, **other)
        assert tuning_key(k, render_triton(k, t), cands, t) != key
    wider = _softmax_kernel(4096, 2048)
    assert tuning_key(wider, render_triton(wider, TRITON), cands, TRITON) != key


def test_max_autotune_means_tuning_and_measured_products():
    assert _checked_options("max-autotune", None) == {"cudagraphs": True, "autotune": True, "gemm": "auto"}
    no_graphs = _checked_options("max-autotune-no-cudagraphs", None)
    assert no_graphs == {"cudagraphs_default": False, "autotune": True, "gemm": "auto"}
    assert "autotune" not in _checked_options("default", None)


def test_max_autotune_through_the_interpreter_tunes_and_matches_eager(tmp_path):
    # Every kernel tuned (min_bytes=1), three candidates each, timed on the host's clock.
    def f(x, w):
        return torch.softmax(x * w, dim=-1) + x.sum(0)

    options = {
        "strict": True,
        "backend": "triton",
        "cache_dir": str(tmp_path),
        "heuristics": "tune.min_bytes=1,tune.max_candidates=3",
        "autotune_min_s": 60.0,
    }
    x, w = torch.randn(8, 24), torch.randn(24)
    with config.override(**options):  # torch.compile takes a mode or options, not both
        compiled = torch.compile(f, backend="ember", mode="max-autotune-no-cudagraphs")
        torch.testing.assert_close(compiled(x, w), f(x, w), rtol=1e-5, atol=1e-5)
        keys = [path.name for path in (tmp_path / "tuning").glob("*/*")]
        assert keys, "no kernel was tuned"
        for key in keys:
            seconds = json.loads(DiskCache().get("tuning", key)["timings.json"])["seconds"]
            assert len(seconds) >= 2 and all(s is not None and s > 0 for s in seconds), seconds


def test_gemm_choices_share_the_budget(tmp_path):
    # gemm=auto's measurements (one per shape class) start only while the graph's tuning budget
    # lasts; a shape measured before is read from the cache whatever the budget.
    from ember.backends.gemm_tuning import _cache_key, measure
    from ember.schedule.gemm import GemmProblem

    def no_loading(source):
        raise AssertionError("no budget left: nothing is compiled")

    problem = GemmProblem(1, 512, 256, 128, torch.float16, "row", "row", "cuda:0")
    spent = Budget(0.0, 1.0, 0.0, spent=1.0)
    timer = FakeTimer({})
    with config.override(cache_dir=str(tmp_path)):
        assert measure(problem, torch.device("cuda", 0), TRITON, no_loading, lambda: (timer, spent)) is None
        timings = {"aten": 1e-4, "configs": [], "seconds": 1.5}
        DiskCache().put("gemm", _cache_key(problem, TRITON), {"timings.json": json.dumps(timings).encode()})
        assert measure(problem, torch.device("cuda", 0), TRITON, no_loading, lambda: (timer, spent)) == timings


class PricedTimer(FakeTimer):
    """Prices a candidate by the launch it makes (`run.launch`), without running it."""

    def __init__(self, price):
        super().__init__({})
        self.price = price

    def time(self, run) -> float:
        self.timed.append(run.launch)
        return self.price(run.launch)


@pytest.mark.parametrize("rounds", [1, 2])
def test_rounds_of_coordinate_descent_start_from_the_last_winner(tmp_path, rounds):
    # Rows of 32 held whole, 64 rows: the heuristic takes 32 rows a program on a one-SM target. A
    # timer that prices a program's rows makes each round halve XBLOCK: 16, then 8.
    target = dataclasses.replace(TRITON, sm_count=1)
    target = target.tuned(f"tune.min_bytes=1,tune.rounds={rounds},tune.max_candidates=3")
    k = _softmax_kernel(64, 32)
    assert launch_config(k, target).xblock == 32
    timer, budget = PricedTimer(lambda c: float(c.xblock)), Budget(0, 100, 0)
    with config.override(cache_dir=str(tmp_path)):
        chosen = tune_launches(
            [k], {k.name: render_triton(k, target)}, target, None, TritonBackend()._load, timer, budget
        )
        assert chosen[k.name].launch.xblock == 32 >> rounds
        assert len(budget.spent_on) == rounds and len(list((tmp_path / "tuning").glob("*/*"))) == rounds
        # Again: every round read from the disk cache, nothing run or timed.
        again = PricedTimer(lambda c: float(c.xblock))
        chosen = tune_launches([k], {k.name: render_triton(k, target)}, target, None, None, again, Budget(0, 0, 0))
        assert chosen[k.name].launch.xblock == 32 >> rounds and not again.timed
