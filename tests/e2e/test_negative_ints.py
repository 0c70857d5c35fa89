"""Integers that may be negative (a Python int under dynamic shapes, `.item()` of a tensor) in size
arithmetic: ember's symbols are non-negative sizes, so an expression whose value depends on the sign
(max/min, a comparison, floor division, modulo) is refused and the graph runs eagerly, with a warning,
rather than simplified on a false assumption (`max(n, 0)` as `n`, `n >= 0` as True)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers import repro

PROGRAMS = {
    "max": lambda x, n: x * max(n, 0),
    "floordiv": lambda x, n: x * (n // 4),
    "mod": lambda x, n: x * (n % 4),
    "cond": lambda x, n: torch.cond(n >= 0, lambda x: x + 100, lambda x: x - 100, (x,)),
    "plain": lambda x, n: x * n + 1,  # sign-insensitive: compiles
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_python_int_that_may_be_negative_matches_eager(name):
    fn = PROGRAMS[name]
    compiled = torch.compile(fn, backend="ember", dynamic=True, options={"backend": "cpp"})
    x = torch.tensor([0.5, 1.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (5, 7, -3, -6):
            got = compiled(x, n)
            assert torch.equal(got, fn(x, n)), repro(program=name, n=n, got=got.tolist(), eager=fn(x, n).tolist())
    fell_back = any("eagerly" in str(w.message) and "may be negative" in str(w.message) for w in caught)
    assert fell_back == (name != "plain"), repro(program=name, warnings=[str(w.message)[:80] for w in caught])


def test_item_that_may_be_negative_matches_eager():
    def fn(x, t):
        return x * (t.item() // 2)

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(fn, backend="ember", options={"backend": "cpp"})
        x = torch.tensor([0.5, 1.0])
        with pytest.warns(UserWarning, match="ember"):
            got = compiled(x, torch.tensor(-3))
    assert torch.equal(got, fn(x, torch.tensor(-3))), repro(program="x * (t.item() // 2)", t=-3, got=got.tolist())
