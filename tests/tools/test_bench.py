"""`ember bench` end to end on a tiny CPU subset: records, table, JSON lines, PNG, sane numbers.

One harness run (module-scoped) over three workloads, one of them in training mode, with compile
times for one case in fresh subprocesses. Numbers are checked for sanity and consistency, never for
speed: timed assertions do not belong in tests.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch

import ember
from ember.tools.bench import measure, report
from ember.tools.bench.__main__ import main as bench_main
from ember.tools.bench.workloads import WORKLOADS, select

CASES = ["pointwise3/inference", "softmax/inference", "gpt2_blocks/train"]
COMPILERS = ["inductor", "ember"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = [
        "--scale", "tiny", "--device", "cpu", "--workloads", "pointwise3,softmax,gpt2_blocks/train",
        "--compile-time", "pointwise3", "--cpu-budget-s", "0.05", "--rounds", "2", "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0, "a compiled output did not match eager"
    return out


@pytest.fixture(scope="module")
def records(run_dir):
    return report.load_jsonl([str(run_dir / "results.jsonl")])


def test_outputs_written(run_dir):
    for name in ("results.jsonl", "table.md", "table.txt"):
        assert (run_dir / name).stat().st_size > 0, name
    if importlib.util.find_spec("matplotlib") is not None:
        png = run_dir / "bench.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (run_dir / "table.md").read_text()
    for key in CASES:
        workload, mode = key.split("/")
        assert f"| {workload} | {mode} |" in table, f"{key} has no row:\n{table}"


def test_every_case_checked_and_timed(records):
    cases = {r["case"]: r for r in records if r["type"] == "case"}
    assert sorted(cases) == sorted(CASES)
    for key, case in cases.items():
        assert "error" not in case and "skipped" not in case, case
        assert case["compilers"]["eager"]["ms"] > 0
        for comp in COMPILERS:
            c = case["compilers"][comp]
            # correctness was checked against the float32 reference before timing
            assert c["status"] in ("ok", "fell back"), f"{key} {comp}: {c}"
            assert math.isfinite(c["err"]) and c["err"] <= c["tol"]
            assert c["ms"] > 0 and c["first_call_s"] > 0
            assert c["peak_mb"] is not None and c["peak_mb"] >= 0  # CPU: from the profiler's memory events
        ember = case["compilers"]["ember"]
        assert ember["graphs"] >= (2 if case["mode"] == "train" else 1)  # forward and backward
        assert ember["kernels"] >= 1 and not ember["fallbacks"], ember


def test_ratios_consistent(records):
    run = report.Run.of(records)
    for case in run.cases.values():
        eager, ind, emb = (case["compilers"][c]["ms"] for c in ("eager", "inductor", "ember"))
        assert report.speedup(case, "ember") == pytest.approx(eager / emb)
        assert report.versus(case, "ember") == pytest.approx(ind / emb)
        # ember ÷ Inductor is the ratio of the two speed-ups over eager, all from one run
        assert report.versus(case, "ember") == pytest.approx(
            report.speedup(case, "ember") / report.speedup(case, "inductor")
        )
        # two rounds that took turns: each time is the median of its rounds, each round has a ratio
        for comp in ("eager", *COMPILERS):
            c = case["compilers"][comp]
            assert len(c["ms_rounds"]) == 2 and c["ms"] == pytest.approx(sum(c["ms_rounds"]) / 2)
        by_round = report.versus_by_round(case, "ember")
        assert len(by_round) == 2 and min(by_round) <= report.versus(case, "ember") * 1.0001
        limit = case["limit"]
        assert limit["bytes"] > 0 and limit["floor_ms"] > 0
        assert report.fraction_of_limit(case, "ember") == pytest.approx(limit["floor_ms"] / emb)
    gpt2 = run.cases["gpt2_blocks/train"]["limit"]
    assert gpt2["flops"] > 0 and gpt2["flops"] > _flops("gpt2_blocks", "inference") * 2


def _flops(workload: str, mode: str) -> float:
    """The FLOPs the bench counts for a step of `workload` in `mode` at the tiny scale, on the CPU."""
    built = WORKLOADS[workload].instance("tiny", torch.device("cpu"), mode)
    step = measure.Step(built.fn, mode == "train", built.autocast, torch.device("cpu"))
    return measure.count_flops(step, measure.prepare_inputs(built.inputs, mode == "train"))


def test_ceilings_and_compile_times(records):
    env = next(r for r in records if r["type"] == "run")
    assert env["torch"] == torch.__version__ and env["compilers"] == COMPILERS
    assert env["settings"] == ember.config.changed()  # (the tests' own cache folder among them)
    ceilings = next(r for r in records if r["type"] == "ceilings")
    assert ceilings["bandwidth_Bps"] > 0 and all(v > 0 for v in ceilings["flops"].values())
    compiles = [r for r in records if r["type"] == "compile"]
    assert [r["case"] for r in compiles] == ["pointwise3/inference"]
    for comp in COMPILERS:
        cold, warm = compiles[0]["compilers"][comp]["cold"], compiles[0]["compilers"][comp]["warm"]
        assert "error" not in cold and "error" not in warm, (cold, warm)
        for m in (cold, warm):
            assert m["seconds"] >= m["startup_s"] > 0 and m["first_step_s"] > 0
    # ember's cold compile by pipeline stage: a part of its first step; Inductor has none
    stages = compiles[0]["compilers"]["ember"]["cold"]["ember_stages_s"]
    assert {"import", "schedule", "build", "host"} <= set(stages), stages
    assert 0 < sum(stages.values()) <= compiles[0]["compilers"]["ember"]["cold"]["first_step_s"], stages
    assert compiles[0]["compilers"]["inductor"]["cold"]["ember_stages_s"] == {}
    # Each first step split into Dynamo, AOTAutograd, the compiler and the first run (compile_stages.py).
    for comp in COMPILERS:
        cold = compiles[0]["compilers"][comp]["cold"]
        top = [cold["breakdown"][k] for k in ("dynamo", "aot_autograd", "compiler", "first run")]
        assert min(top) >= 0 and 0 < sum(top) <= cold["first_step_s"] * 1.05 + 0.05, cold["breakdown"]
    assert compiles[0]["compilers"]["ember"]["cold"]["breakdown"]["ember: build"] > 0


def test_rerender_from_jsonl(run_dir, tmp_path):
    assert bench_main(["--from-jsonl", str(run_dir / "results.jsonl"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "table.md").read_text() == (run_dir / "table.md").read_text()


def test_mismatch_is_reported_not_timed():
    """A compiled output that disagrees with the reference gets status "mismatch" and no time."""
    case = {"compilers": {"eager": {"status": "ok", "ms": 1.0}, "ember": {"status": "mismatch", "err": 0.5}}}
    assert report.ms_of(case, "ember") is None and report.speedup(case, "ember") is None
    assert report._cell_ms(case, "ember").startswith("MISMATCH")
    assert measure.max_err([torch.ones(3)], [torch.zeros(3)]) > measure.tolerance(torch.float32, 0.0)
    assert not measure.max_err([torch.full((2,), math.nan)], [torch.ones(2)]) <= 1.0


def test_host_bound_gpu_time_is_marked():
    """On a GPU a call's time is the larger of its device and host times; the table says which."""
    case = {
        "compilers": {
            "eager": {"status": "ok", "ms": 0.5, "device_ms": 0.3, "host_ms": 0.5},
            "ember": {"status": "ok", "ms": 0.4, "device_ms": 0.4, "host_ms": 0.1},
        }
    }
    assert report._cell_ms(case, "eager") == "0.500 (host)"
    assert report._cell_ms(case, "ember") == "0.400"


def test_missing_optional_package_skips_with_a_note(monkeypatch):
    w = WORKLOADS["hf_bert"]
    monkeypatch.setattr("importlib.import_module", lambda name: (_ for _ in ()).throw(ImportError(name)))
    from ember.tools.bench import workloads

    assert "not importable" in workloads.missing_requirement(w)


def test_selection_and_sizes():
    keys = [c.key for c in select("micro", "inference")]
    assert keys[0] == "pointwise3/inference" and "tiny_mlp_b1/inference" in keys and len(keys) == 10
    assert {c.key for c in select("gpt2_blocks")} == {"gpt2_blocks/inference", "gpt2_blocks/train"}
    # "workload/mode" names one case, whatever --modes says
    assert [c.key for c in select("softmax,gpt2_blocks/train", "inference")] == [
        "softmax/inference",
        "gpt2_blocks/train",
    ]
    assert [c.key for c in select("gpt2_blocks/train,gpt2_blocks/inference", "inference")] == [
        "gpt2_blocks/inference",
        "gpt2_blocks/train",
    ]
    assert len(select("gpt2_blocks,gpt2_blocks/train")) == 2  # the plain name keeps every mode
    with pytest.raises(ValueError, match="softmax runs in inference"):
        select("softmax/train")
    assert WORKLOADS["softmax"].sizes["gpu"] == (8192, 8192)
    assert WORKLOADS["cross_entropy"].sizes["gpu"] == (8192, 50257)
    with pytest.raises(ValueError, match="unknown workload"):
        select("nope")


def test_rotation_copies_small_inputs():
    x = torch.randn(16, 16)
    assert measure.rotations((x,), cache=1 << 20) > 1
    assert measure.rotations((x,), cache=16) == 1
    sets = measure.copies_of((x,), 3)
    assert len(sets) == 3 and all(torch.equal(s[0], x) for s in sets)
    assert sets[1][0].data_ptr() != x.data_ptr()


def test_json_lines_are_json(run_dir):
    with open(os.path.join(run_dir, "results.jsonl")) as f:
        for line in f:
            json.loads(line)


def test_terminal_table_fits_80_columns(records):
    """The default table keeps its main columns and fits an 80-column terminal without folding a
    cell; --wide and the files keep every column."""
    import io

    from rich.console import Console

    run = report.Run.of(records)
    console = Console(width=80, file=io.StringIO(), record=True)
    report.print_table(run, console=console)
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    for key in CASES:
        workload, mode = key.split("/")
        row = [ln for ln in lines if ln.split()[:2] == [workload, "infer" if mode == "inference" else mode]]
        assert len(row) == 1, f"{key}: no one-line row (a folded cell?)\n{text}"
        assert row[0].count("×") >= 1, row  # ember's speed-up is there
    assert "peak MB" not in text and "peak MB" in report.plain(run), "peak memory: --wide and the files only"
    wide = Console(width=200, file=io.StringIO(), record=True)
    report.print_table(run, console=wide, wide=True)
    assert "peak MB" in wide.export_text()


def test_list_shows_this_devices_sizes(capsys):
    assert bench_main(["--list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    softmax = next(line for line in out.splitlines() if line.startswith("softmax "))
    assert softmax.endswith(WORKLOADS["softmax"].describe(WORKLOADS["softmax"].sizes["cpu"])), softmax
    assert WORKLOADS["softmax"].sizes["cpu"] != WORKLOADS["softmax"].sizes["gpu"]
    assert bench_main(["--list", "--scale", "gpu"]) == 0
    assert "8192×8192" in capsys.readouterr().out


def test_cpu_peak_memory_prints_no_profiler_noise():
    """The CPU peak runs under torch.profiler, whose back end logs each start and stop to stderr."""
    import subprocess
    import sys

    child = (
        "import torch\n"
        "from ember.tools.bench import memory\n"
        "for _ in range(3):\n"
        "    peak = memory.peak_memory_mb(lambda x: x * 2, (torch.ones(1000),), torch.device('cpu'))\n"
        "print(peak)\n"
    )
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.strip()) > 0, r.stdout
    assert "profiler_start" not in r.stderr and "profiler_stop" not in r.stderr, r.stderr[-2000:]


def test_flop_formulas_count_gqa_attention_over_every_query_head():
    """torch's FLOP formula for the CUDA SDPA ops asserts equal query and key heads; the bench's own
    formulas count a GQA call as its key/value heads shared by every query head."""
    from torch.utils import flop_counter as fc

    from ember.tools.bench import measure

    formulas = measure._sdpa_formulas()
    q, kv, grad = (2, 8, 128, 64), (2, 2, 128, 64), (2, 8, 128, 64)
    full = fc.sdpa_flop_count(q, q, q)
    for op, formula in formulas.items():
        if "backward" in str(op):
            assert formula(grad, q, kv, kv) == fc.sdpa_backward_flop_count(grad, q, q, q), op
        else:
            assert formula(q, kv, kv) == full, op
    assert any("flash_attention_for_cpu" in str(op) for op in formulas)


def test_float32_workloads_are_checked_against_float64_where_the_step_runs_there():
    # A float32 module: the reference is the step in float64, so eager's own float32 error sets the
    # tolerance. A function over a float32 tensor it captured cannot run in float64: float32 then.
    from ember.tools.bench.built import Built

    cpu = torch.device("cpu")
    x = torch.randn(8, 16)
    module = torch.nn.Linear(16, 4)
    (ref,), dtype = measure.reference(Built(module, (x,)), (x,), False, cpu, torch.float32)
    assert ref.dtype == dtype == torch.float64
    torch.testing.assert_close(ref.float(), module(x).detach(), rtol=1e-5, atol=1e-5)
    weight = torch.randn(16, 4)
    (ref,), dtype = measure.reference(Built(lambda a: a @ weight, (x,)), (x,), False, cpu, torch.float32)
    assert ref.dtype == dtype == torch.float32
    (ref,), _ = measure.reference(
        Built(module.to(torch.bfloat16), (x.bfloat16(),)), (x.bfloat16(),), False, cpu, torch.bfloat16
    )
    assert ref.dtype == torch.float32


def test_a_float64_reference_differentiates_along_the_same_cotangents():
    # randn draws other numbers in float64 than in float32 past 16 elements: the cotangents are drawn in
    # float32 and cast, so eager's float32 gradients sit within rounding of the float64 reference's.
    from ember.tools.bench.built import Built

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48))
    inputs = measure.prepare_inputs((torch.randn(32, 16),), True)
    ref, _ = measure.reference(Built(module, inputs), inputs, True, cpu, torch.float32)
    assert all(r.dtype == torch.float64 for r in ref)
    eager = measure.Step(module, True, None, cpu)(*inputs)
    assert measure.max_err(eager, ref) < 1e-5


def test_each_output_is_held_to_its_own_tolerance():
    # Eager is far from the reference on the second output only: that loosens the second's tolerance,
    # not the first's, and the worst output is the one furthest past its own.
    ref = [torch.ones(4), torch.ones(4)]
    eager = [torch.ones(4), torch.full((4,), 1.5)]
    tols = measure.tolerances(torch.float32, measure.errors(eager, ref))
    assert tols == [1e-4, 2 * 0.5 + 1e-4]
    assert measure.worst([torch.ones(4), torch.full((4,), 1.9)], ref, tols)[0] <= tols[1]
    err, tol = measure.worst([torch.full((4,), 1.01), torch.ones(4)], ref, tols)
    assert (err, tol) == (pytest.approx(0.01), 1e-4) and not err <= tol
    err, tol = measure.worst([torch.full((4,), math.nan), torch.ones(4)], ref, tols)
    assert not err <= tol


def test_float32_outputs_are_judged_by_the_float64_rule():
    # Against a float64 reference each output passes where allclose to eager's, or where its RMSE is at
    # most twice eager's plus tol/10 (accuracy.py's rule); an output further off fails, by name.
    from ember.tools.bench import harness

    gen = torch.Generator().manual_seed(0)
    ref = [torch.linspace(-1, 1, 256, dtype=torch.float64), torch.linspace(0, 2, 256, dtype=torch.float64)]
    noise = [torch.randn(256, generator=gen) for _ in ref]
    eager = [r.float() + 1e-2 * n for r, n in zip(ref, noise)]
    check = harness.checker(ref, eager, torch.float64, torch.float32, train=True)
    assert check([e.clone() for e in eager])[2] is None
    assert check([ref[0].float() + 1.5e-2 * noise[0], eager[1]])[2] is None
    err, tol, failure = check([eager[0], ref[1].float() + 0.1])
    assert failure.startswith("output 1: RMSE") and err > tol
