"""Tables re-rendered from several runs (`ember bench --from-jsonl a b`): fake records, no timing."""

from __future__ import annotations

from ember.tools.bench import report


def _run(bandwidth: float, date: str) -> list[dict]:
    env = {"type": "run", "device": "GPU", "cpus": 16, "torch": "t", "triton": "t", "python": "3"}
    env |= {"scale": "gpu", "date": date, "compilers": ["ember"], "load_average": [0.1, 0.1, 0.1]}
    ceilings = {"type": "ceilings", "bandwidth_Bps": bandwidth, "flops": {"float32": 5e13}}
    return [env, ceilings]


def test_a_memory_bound_row_keeps_its_label_when_runs_with_other_ceilings_are_merged():
    n_bytes = 134217728
    floor_ms = n_bytes / 3007.6e9 * 1000  # the case was measured in the second run
    case = {"type": "case", "case": "pointwise3/inference", "workload": "pointwise3", "mode": "inference"}
    case |= {"limit": {"bytes": n_bytes, "flops": 0, "floor_ms": floor_ms}}
    case["compilers"] = {"eager": {"status": "ok", "ms": 0.146}, "ember": {"status": "ok", "ms": 0.050}}
    # The first run's copy ceiling is 0.02% higher; its ceilings are the ones the table shows.
    records = _run(3008.2e9, "first") + _run(3007.6e9, "second") + [case]
    header, rows, _ = report.table_rows(report.Run.of(records))
    assert rows[0][header.index("limit ms")] == f"{floor_ms:.3f} (mem)"
