"""How the demo times and when the demo and the bench distrust a time: fake clocks and fake timings only."""

from __future__ import annotations

import statistics

import pytest

from ember.tools import demo, timing_noise
from ember.tools.bench import report as bench_report
from ember.tools.timing_noise import Spread, load_warning, spread_warning


class FakeClock:
    """A clock that moves only when a fake function 'runs'; `cost_ms(k)` is the k-th call's cost."""

    def __init__(self):
        self.now = 0.0
        self.log: list[str] = []

    def __call__(self) -> float:
        return self.now

    def function(self, name: str, cost_ms):
        calls = iter(range(1 << 30))

        def fn():
            self.log.append(name)
            self.now += cost_ms(next(calls)) / 1000

        return fn


def test_spread_is_min_median_max():
    s = Spread.of([3.0, 1.0, 2.0, 10.0, 2.5])
    assert (s.low, s.median, s.high) == (1.0, 2.5, 10.0)
    assert s.relative == pytest.approx(9.0 / 2.5)
    assert Spread.of([2.0, 2.0]).relative == 0.0
    with pytest.raises(ValueError):
        Spread.of([])


def test_spread_warning_only_when_rounds_disagree():
    assert spread_warning("softmax, eager", [1.00, 1.05, 0.98, 1.02, 1.01]) is None
    assert spread_warning("softmax, eager", [5.0]) is None  # one round: nothing to compare
    # The rounds the issue saw on a busy 2-core machine: 0.25 ms and 37 ms for the same call.
    w = spread_warning("softmax, eager", [0.25, 0.26, 37.0, 0.25, 0.3])
    assert w is not None and "softmax, eager" in w and "0.25 to 37 ms" in w and "not reliable" in w


def test_load_warning_relative_to_the_usable_cores():
    assert load_warning(0.4, 2) is None
    assert load_warning(None, 2) is None  # no load average on this platform: nothing to say
    assert load_warning(12.0, 64) is None  # a big host with a few busy cores
    w = load_warning(1.9, 2)
    assert w is not None and "1.90" in w and "2 usable CPUs" in w
    assert load_warning(timing_noise.LOAD_PER_CORE_LIMIT * 8 + 0.1, 8) is not None


def test_demo_rounds_take_turns_and_rotate():
    clock = FakeClock()
    fns = {"eager": clock.function("eager", lambda k: 2.0), "ember": clock.function("ember", lambda k: 1.0)}
    times = demo.time_in_rounds(fns, "cpu", rounds=4, clock=clock)
    assert times["eager"] == pytest.approx([2.0] * 4) and times["ember"] == pytest.approx([1.0] * 4)
    # 3 warm-up calls and one sizing call each; then every round runs each function's calls back to
    # back (about ROUND_MS of them), and the function that goes first alternates.
    timed = clock.log[8:]
    n_eager = timed.index("ember")
    n_ember = len(timed) // 4 - n_eager
    assert abs(n_eager - demo.ROUND_MS / 2.0) <= 1 and abs(n_ember - demo.ROUND_MS / 1.0) <= 1
    eager, ember = ["eager"] * n_eager, ["ember"] * n_ember
    assert timed == (eager + ember) + (ember + eager) + (eager + ember) + (ember + eager)
    assert demo._calls_per_round(lambda: None, "cpu", lambda: 0.0) == 10_000  # a call too fast to see: capped


def test_demo_reports_median_and_range_and_warns_on_a_noisy_round():
    clock = FakeClock()
    # Eager's third round runs 100x slower (another process took the CPU); ember's rounds agree.
    n = int(demo.ROUND_MS / 2.0)
    slow = range(4 + 2 * n, 4 + 3 * n)  # after 3 warm-up calls, one sizing call and two rounds of n calls
    fns = {
        "eager": clock.function("eager", lambda k: 200.0 if k in slow else 2.0),
        "ember": clock.function("ember", lambda k: 1.0),
    }
    times = demo.time_in_rounds(fns, "cpu", rounds=5, clock=clock)
    assert times["eager"] == pytest.approx([2.0, 2.0, 200.0, 2.0, 2.0])
    timing = demo.Timing.of("softmax", [2.0, 2.0, 200.0, 2.0, 2.0], [1.0] * 5)
    assert timing.eager.median == 2.0 and timing.speedup.median == 2.0
    assert (timing.speedup.low, timing.speedup.high) == (2.0, 200.0)
    assert len(timing.warnings) == 1 and timing.warnings[0].startswith("softmax, eager: rounds took 2 to 200 ms")
    row = demo.format_row("softmax", 1.5, timing, 1, True)
    assert row.split() == ["softmax", "1.50", "2", "1", "2.00x", "2.00-200x", "1", "yes"]
    assert len(row) < 80 and len(demo.HEADER) < 80
    wide = demo.Timing.of("gelu_tanh", [80.0, 100.0, 90.0], [8.0, 7.0, 7.5])
    assert demo.format_row("gelu_tanh", 0.3, wide, 1, True).split()[5] == "10.0-14.3x"

    quiet = demo.Timing.of("softmax", [2.0, 2.1, 1.9], [1.0, 1.0, 1.05])
    assert quiet.warnings == ()


def _bench_records(load: list[float], eager_rounds: list[float]) -> list[dict]:
    env = {"type": "run", "device": "CPU: test", "cpus": 2, "torch": "t", "triton": "t", "python": "3"}
    env |= {"scale": "cpu", "date": "d", "compilers": ["ember"], "load_average": load}
    case = {"type": "case", "case": "softmax/inference", "workload": "softmax", "mode": "inference"}
    case["compilers"] = {
        "eager": {"status": "ok", "ms": statistics.median(eager_rounds), "ms_rounds": eager_rounds},
        "ember": {"status": "ok", "ms": 1.0, "ms_rounds": [1.0, 1.02, 0.99]},
    }
    return [env, case]


def test_bench_table_warns_about_a_busy_machine_and_uneven_rounds():
    _, _, notes = bench_report.table_rows(bench_report.Run.of(_bench_records([3.4, 2.3, 1.0], [0.25, 37.0, 0.3])))
    busy = [n for n in notes if "load average is 3.40 on 2 usable CPUs" in n]
    uneven = [n for n in notes if n.startswith("softmax/inference: eager: rounds took 0.25 to 37 ms")]
    assert len(busy) == 1 and busy[0].startswith("when the run of d on CPU: test began") and len(uneven) == 1
    assert not [n for n in notes if "ember: rounds" in n]  # ember's rounds agree

    _, _, quiet = bench_report.table_rows(bench_report.Run.of(_bench_records([0.1, 0.1, 0.1], [2.0, 2.1, 1.9])))
    assert quiet == []
