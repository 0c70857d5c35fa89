"""`ember bench --workloads dynamic` at tiny scale on the CPU, eager and ember (Inductor's C++ compiles
are too slow for CI; its columns are checked on a made-up record): every size runs and passes the
float64 rule, ember compiles at most two frames with dynamic=None (static at the first size, then
once with the size symbolic), and the record keeps each size's times. Numbers are checked for
consistency, never for speed.
"""

from __future__ import annotations

import math

import pytest
import torch

from ember.tools.bench import dynamic, report
from ember.tools.bench.__main__ import main as bench_main
from ember.tools.bench.workloads import WORKLOADS, select

NAMES = ["dyn_gpt2_block", "dyn_convnet"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-dynamic")
    argv = [
        "--scale", "tiny", "--device", "cpu", "--workloads", "dynamic", "--no-inductor",
        "--cpu-budget-s", "0.01", "--rounds", "1", "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0, "a compiled output failed the float64 rule"
    return out


@pytest.fixture(scope="module")
def rows(run_dir):
    records = report.load_jsonl([str(run_dir / "results.jsonl")])
    return {r["workload"]: r for r in records if r.get("type") == "case"}


def test_dynamic_group_and_sizes():
    assert [c.key for c in select("dynamic")] == [f"{n}/dynamic" for n in NAMES]
    lengths = WORKLOADS["dyn_gpt2_block"].sizes["gpu"][-1]
    assert len(set(lengths)) >= 16 and min(lengths) == 64 and max(lengths) == 1024
    assert any(t % 16 for t in lengths), "lengths that are not multiples of 16"
    assert len(set(WORKLOADS["dyn_convnet"].sizes["gpu"][-1])) >= 4
    for name in NAMES:
        assert len(WORKLOADS[name].sizes["tiny"][-1]) >= 4


def test_every_size_ran_and_passes_the_float64_rule(rows):
    assert sorted(rows) == sorted(NAMES)
    for name, row in rows.items():
        assert "error" not in row and "skipped" not in row, row
        assert row["kind"] == "dynamic" and row["sizes"] == list(WORKLOADS[name].sizes["tiny"][-1])
        for compiler in ("eager", "ember"):
            c = row["compilers"][compiler]
            assert c["status"] == "ok", f"{name} {compiler}: {c}"
            assert [p["size"] for p in c["sizes"]] == row["sizes"]
            assert all(p["float64"] == "pass" for p in c["sizes"]), c["sizes"]


def test_ember_compiles_at_most_two_frames(rows):
    """dynamic=None: static at the first size, once more with the size symbolic, then no more."""
    for name, row in rows.items():
        ember = row["compilers"]["ember"]
        assert 1 <= ember["frames"] <= 2, f"{name}: {ember['frames']} frames: {ember['recompile_reasons']}"
        assert not ember["graph_breaks"] and not ember["fallbacks"], ember
        assert "recompiled_while_timing" not in ember
        assert ember["kernels"] >= 1 and ember["compile_s"] > 0


def test_record_holds_each_sizes_times(rows):
    for row in rows.values():
        for c in row["compilers"].values():
            assert all(p["ms"] > 0 and p["first_call_s"] > 0 and len(p["ms_rounds"]) == 1 for p in c["sizes"])
            # the compiler's time is the geometric mean over sizes
            assert c["ms"] == pytest.approx(math.prod(p["ms"] for p in c["sizes"]) ** (1 / len(c["sizes"])))
            assert c["compile_s"] == pytest.approx(sum(p["first_call_s"] for p in c["sizes"]))


def test_table_has_the_dynamic_columns(run_dir):
    table = (run_dir / "table.md").read_text()
    assert report.DYNAMIC_TITLE in table
    header = next(line for line in table.splitlines() if line.startswith("| workload"))
    for column in ("ember frames", "ember compile s", "eager ms", "ember ms", "ember float64"):
        assert column in header, header
    for name in NAMES:
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        sizes = len(WORKLOADS[name].sizes["tiny"][-1])
        assert f"| {sizes}/{sizes} |" in row and "| 2 |" in row, row


def test_ratio_to_inductor_is_the_geometric_mean_over_sizes():
    """ember ÷ Inductor is Inductor ms ÷ ember ms at each size, averaged geometrically; a row where
    Inductor failed one size has no ratio."""

    def compiler(ms, frames):
        sizes = [{"size": s, "ms": t, "float64": "pass", "first_call_s": 1.0} for s, t in zip((4, 7, 9), ms)]
        return {"status": "ok", "frames": frames, "compile_s": 3.0, "sizes": sizes, "ms": dynamic.geomean(ms)}

    row = {
        "type": "case",
        "kind": "dynamic",
        "case": "dyn/dynamic",
        "workload": "dyn",
        "mode": "dynamic",
        "compilers": {
            "eager": compiler([4.0, 8.0, 16.0], None),
            "inductor": compiler([1.0, 2.0, 4.0], 2),
            "ember": compiler([0.5, 2.0, 8.0], 2),
        },
    }
    run = report.Run.of([{"type": "run", "compilers": ["inductor", "ember"]}, row])
    assert not run.cases and list(run.dynamic) == ["dyn/dynamic"]
    assert report.versus_by_size(row, "ember") == [2.0, 1.0, 0.5]
    assert report.versus(row, "ember") == pytest.approx(1.0)
    header, rows, _ = report.dynamic_rows(run)
    cells = dict(zip(header, rows[0]))
    assert cells["ember ÷ Inductor"] == "1.00×" and cells["ember ÷ Inductor, sizes min–max"] == "0.50–2.00"
    assert cells["Inductor frames"] == "2" and cells["ember float64"] == "3/3"
    assert any("geometric mean 1.00×" in line for line in report.summary(run))
    row["compilers"]["inductor"]["sizes"][1]["float64"] = "fail"
    row["compilers"]["inductor"]["status"] = "mismatch"
    header, rows, _ = report.dynamic_rows(run)
    assert dict(zip(header, rows[0]))["ember ÷ Inductor"] == "-"
    assert dict(zip(header, rows[0]))["Inductor float64"] == "2/3 FAIL"


def test_each_entry_starts_static_on_its_own():
    """Each compiler's entry has its own code object, so Dynamo's automatic-dynamic record of one does
    not make another's first compile dynamic: both compile static, then once dynamic."""
    model = torch.nn.Linear(4, 4)
    for compiler in ("first", "second"):
        fn = torch.compile(dynamic._entry(model, compiler), backend="eager")
        before = dynamic.graphs_compiled()
        for batch in (2, 3, 5, 9):
            fn(torch.randn(batch, 4))
        assert dynamic.graphs_compiled() - before == 2, compiler


def test_terminal_table_fits_80_columns():
    """The dynamic-shape table's main columns fit an 80-column terminal at the GPU's 16 sizes, beside
    the main table of a fixed-shape row."""
    import io

    from rich.console import Console

    sizes = [{"size": s, "ms": 12.345, "float64": "pass", "first_call_s": 1.0} for s in range(16)]
    timed = {"status": "ok", "frames": 2, "compile_s": 30.0, "sizes": sizes, "ms": 12.345}
    row = {
        "type": "case",
        "kind": "dynamic",
        "case": "dyn_gpt2_block/dynamic",
        "workload": "dyn_gpt2_block",
        "mode": "dynamic",
        "compilers": {"eager": dict(timed, frames=None), "inductor": timed, "ember": timed},
    }
    fixed = {"type": "case", "case": "softmax/inference", "workload": "softmax", "mode": "inference"}
    fixed["compilers"] = {c: {"status": "ok", "ms": 1.0} for c in ("eager", "inductor", "ember")}
    env = {"type": "run", "device": "GPU", "cpus": 16, "torch": "2", "triton": "3", "python": "3", "scale": "gpu"}
    run = report.Run.of([dict(env, date="today", compilers=["inductor", "ember"]), fixed, row])
    console = Console(width=80, file=io.StringIO(), record=True)
    report.print_table(run, console=console)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    for name in ("softmax", "dyn_gpt2_block"):
        assert len([ln for ln in lines if ln.split()[:1] == [name]]) == 1, "\n".join(lines)
    assert "16/16" in next(ln for ln in lines if ln.startswith(" dyn_gpt2_block"))


def test_a_skipped_dynamic_row_stays_in_the_dynamic_table():
    """A row skipped before its build (time budget spent) has no `kind` yet: its mode places it."""
    skipped = {"type": "case", "case": "dyn_convnet/dynamic", "workload": "dyn_convnet", "mode": "dynamic"}
    skipped["skipped"] = "time budget spent"
    run = report.Run.of([{"type": "run", "compilers": ["inductor", "ember"]}, skipped])
    assert "dyn_convnet/dynamic" in run.dynamic and not run.cases
