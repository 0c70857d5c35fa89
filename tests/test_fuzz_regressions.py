"""Bugs the fuzzer (ember/tools/fuzz.py) found, each kept as a program compared with eager.

Each case names the fuzz seed and program it came from (`python -m ember.tools.fuzz --seed S
--only I` regenerates it) and is cut down to the ops that matter.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close, repro


def _squeeze_of_guarded_size_one(x):
    # seed 100, program 64: with dynamic shapes the slice's length is (s + 1) // 3, which a guard
    # makes 1; squeeze(1) dropped the dim in eager but ember kept it (wrong rank).
    v = (x + 1.25)[:, 1::3]
    return torch.floor(v).squeeze(1), v


CASES = {
    "squeeze_of_guarded_size_one": (_squeeze_of_guarded_size_one, [(7, 4, 7)], True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fuzz_regression(name):
    fn, shapes, dynamic = CASES[name]
    inputs = [torch.randn(s) for s in shapes]
    line = repro(program=name, dynamic=dynamic, inputs=inputs)
    expected = fn(*inputs)
    got = torch.compile(fn, backend="ember", dynamic=dynamic, options={"backend": "cpp"})(*inputs)
    expected, got = (expected, got) if isinstance(expected, tuple) else ((expected,), (got,))
    assert len(got) == len(expected), line
    for k, (g, e) in enumerate(zip(got, expected)):
        assert_close(g, e, rtol=1e-5, atol=1e-6, what=f"output {k}", line=line)
