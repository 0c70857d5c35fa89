"""Online softmax (schedule/online.py): a long row's max and sum of exp in one pass.

Rows are made "long" by lowering `persistent_reduction_max`, so the Triton interpreter runs the
looped form the GPU runs for 50257-wide vocabularies. Each program is checked against eager,
including rows that are partly or wholly -inf (masked attention, padded logits) and NaN.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember import config
from tests.helpers import ember_compile, explain_strict

ROWS, COLS = 3, 200  # 200 > persistent_reduction_max below: a looped reduction (RBLOCK 64)


def _logits(kind: str) -> torch.Tensor:
    x = torch.randn(ROWS, COLS) * 4
    if kind == "partly_inf":
        x[0, :150] = float("-inf")  # the first chunks of the row only -inf
        x[1, 7::3] = float("-inf")
    elif kind == "all_inf":
        x[1] = float("-inf")
    elif kind == "nan":
        x[2, 120] = float("nan")
    return x


PROGRAMS = {
    "softmax": lambda x: x.softmax(-1),
    "log_softmax": lambda x: x.log_softmax(-1),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "cross_entropy": lambda x: F.cross_entropy(x, torch.arange(ROWS) * 31 % COLS, reduction="none"),
}


@pytest.mark.parametrize("kind", ["normal", "partly_inf", "all_inf", "nan"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_online_softmax_matches_eager(name, kind):
    fn, x = PROGRAMS[name], _logits(kind)
    with config.override(persistent_reduction_max=64):
        got = ember_compile(fn, "triton")(x)
    want = fn(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m: f"{name} {kind}: {m}")
    assert torch.equal(got.isnan(), want.isnan())


def test_cross_entropy_reads_its_logits_once():
    """Triton, looped rows: the max and the sum of exp share one loop over the row, and the cost
    model counts one read of the logits; the C++ backend keeps the two-pass form (exp is its
    bottleneck, and its rows sit in cache)."""
    x, t = torch.randn(4, 300, dtype=torch.bfloat16), torch.randint(0, 300, (4,))
    logits_bytes = x.numel() * x.element_size()
    with config.override(persistent_reduction_max=64):
        triton = explain_strict(lambda x, t: F.cross_entropy(x, t), x, t, backend="triton")
        cpp = explain_strict(lambda x, t: F.cross_entropy(x, t), x, t, backend="cpp")
    (row,) = [k for k in triton.kernels if "mnew" in k.source]  # the online update
    assert row.source.count("for roffset in range") == 1, row.source
    assert logits_bytes <= row.bytes < 2 * logits_bytes, (row.bytes, logits_bytes)
    assert max(k.bytes for k in cpp.kernels) >= 2 * logits_bytes  # two passes over each row
