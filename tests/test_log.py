"""EMBER_DEBUG levels, EMBER_LOGS artifacts and EMBER_CHECK: what each prints or runs."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from ember import config, log
from tests.helpers import assert_close


def _f(x):
    return torch.softmax(x * 2, -1)


@pytest.fixture
def ember_log():
    """What the `ember` logger prints (it writes to the stderr it found at import, so capture it here)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("[ember] %(message)s"))
    logger = logging.getLogger("ember")
    logger.addHandler(handler)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)


def _run(**options):
    x = torch.randn(4, 16)
    out = torch.compile(_f, backend="ember", options={"backend": "cpp", "strict": True, **options})(x)
    assert_close(out, _f(x), rtol=1e-5, atol=1e-6, what="softmax", line=f"repro: softmax(x*2) options={options}")


def test_quiet_by_default(ember_log):
    _run()
    assert "[ember]" not in ember_log.getvalue()


def test_debug_1_prints_one_summary_line_per_graph(ember_log):
    _run(debug=1)
    lines = [ln for ln in ember_log.getvalue().splitlines() if ln.startswith("[ember]")]
    assert len(lines) == 1, lines
    assert "inference graph" in lines[0] and "1 cpp kernels" in lines[0], lines[0]


def test_debug_2_prints_generated_source(ember_log):
    _run(debug=2)
    err = ember_log.getvalue()
    assert "=== code:" in err and 'extern "C"' in err and "def call(args):" in err, err[:2000]


def test_logs_fusion_artifact_only(ember_log):
    _run(logs="fusion")
    err = ember_log.getvalue()
    assert "=== fusion:" in err
    assert "=== code:" not in err


def test_debug_3_prints_ir_after_passes(ember_log):
    _run(debug=3)
    err = ember_log.getvalue()
    assert "=== graph: after import ===" in err and "graph(" in err, err[:2000]


def test_check_runs_the_verifier():
    _run(check=True)


def test_artifact_levels():
    with config.override(debug=0, logs=""):
        assert not any(log.enabled(a) for a in log.ARTIFACTS)
    with config.override(debug=2, logs=""):
        assert log.enabled("code") and not log.enabled("graph")
    with config.override(debug=0, logs="cache, graph"):
        assert log.enabled("cache") and log.enabled("graph") and not log.enabled("code")


def test_debug_2_prints_the_preamble_once_per_process(ember_log):
    """The generated module's preamble (includes, helpers: some 90 lines of C++) is printed with the
    first graph that has it; later graphs print their kernels and a line that refers to it."""
    from ember import log as ember_log_module

    ember_log_module._preambles_shown.clear()  # as in a fresh process
    for fn in (_f, lambda x: torch.tanh(x) * 3):
        x = torch.randn(4, 16)
        out = torch.compile(fn, backend="ember", options={"backend": "cpp", "strict": True, "debug": 2})(x)
        assert_close(out, fn(x), rtol=1e-5, atol=1e-6, what="output", line="repro: debug=2, two graphs")
    err = ember_log.getvalue()
    assert err.count("=== code: inference kernels ===") == 2, err[:3000]
    assert err.count("#include <cmath>") == 1, err[:3000]
    assert "lines printed above with 'inference kernels', once per process)" in err, err[:3000]
    assert err.count('extern "C"') >= 2, "each graph's own kernels are still printed"
