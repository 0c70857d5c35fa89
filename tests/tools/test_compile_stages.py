"""`ember bench --compile-time`'s stage breakdown (tools/bench/compile_stages.py): a first step split
into Dynamo, AOTAutograd, the compiler and the first run from PyTorch's timers and ember's stages and
counters, and the table written from the records."""

from __future__ import annotations

import pytest

from ember.tools.bench.compile_stages import breakdown, stage_table

METRICS = {
    "_compile.compile_inner": [3.0],
    "OutputGraph.call_user_compiler": [2.5],
    "backward._backward_impl": [1.0],
    "compile_fx_inner": [1.5, 0.8],
    "compile_file": [0.4],
}


def test_ember_first_step_splits_into_dynamo_aot_ember_and_the_run():
    stages = {"import": 0.2, "schedule": 0.3, "build": 1.0}
    counters = {"build_compile_s": 0.7, "triton_cubin_s": 0.4, "kernels_compiled": 5, "kernel_dedup_hits": 7}
    b = breakdown(5.0, METRICS, stages, counters, "ember")
    assert b["dynamo"] == pytest.approx(0.5)  # the frame's compile less the backend's part
    assert b["compiler"] == pytest.approx(1.5)
    assert b["aot_autograd"] == pytest.approx(2.5 + 1.0 - 1.5)  # the lazy backward included
    assert b["first run"] == pytest.approx(5.0 - 3.0 - 1.0)
    assert b["ember: build"] == 1.0 and b["triton: ptxas (cpu)"] == 0.4
    assert b["count: kernel_dedup_hits"] == 7


def test_inductor_regions_and_the_table():
    b = breakdown(5.0, METRICS, {}, {}, "inductor")
    assert b["compiler"] == pytest.approx(2.3) and b["inductor: C++ builds"] == 0.4
    record = {
        "type": "compile",
        "case": "mlp/train",
        "compilers": {"inductor": {"cold": {"seconds": 9.0, "startup_s": 3.0, "breakdown": b}, "warm": {"error": "x"}}},
    }
    table = stage_table([record])
    assert "| mlp/train | inductor | cold | 9.00 | 3.00 | 0.50 |" in table
    assert "| mlp/train | inductor | warm | x |" in table
    assert "inductor: C++ builds 0.40" in table
