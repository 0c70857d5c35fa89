"""How a schedule is pickled and unpickled (runtime/schedule_cache.py): size and index expressions come
back as the very expressions stored, rebuilt without simplifying them again; the garbage collector
is paused while a pickle loads and left as it was found; the kernels' costs travel with the schedule."""

from __future__ import annotations

import gc
import pickle

import pytest
import sympy
import torch
import torch._dynamo

import ember
from ember.ir.sizes import IndexDiv, IndexMod, index_symbol
from ember.runtime import schedule_cache
from ember.schedule import cost
from tests.helpers import explain_strict

x, y, n = index_symbol("x0"), index_symbol("x1"), sympy.Symbol("s0", integer=True, positive=True)
EXPRESSIONS = [
    x + 2 * y + 3,
    4 * x * y,
    x**2,
    sympy.Max(x, y + 1, 3),
    sympy.Min(n, 64),
    IndexDiv(x + 7 * y, 8),
    IndexMod(x, 16) + IndexDiv(y, 4) * 16,
    sympy.Min(sympy.Max(IndexMod(x + y, 3), 1) * n, 1024),
    sympy.Add(x, x, evaluate=False),  # as it was made, not as sympy would simplify it
    sympy.And(sympy.Ge(n, 2), sympy.Le(n, 4096)),  # pickled as sympy does
    sympy.Integer(7),
    sympy.Rational(3, 4),
]


@pytest.mark.parametrize("expr", EXPRESSIONS, ids=str)
def test_an_expression_comes_back_as_it_was(expr):
    again = schedule_cache.loads(schedule_cache.dumps({"e": expr}))["e"]
    assert type(again) is type(expr) and again == expr and hash(again) == hash(expr)
    assert sympy.srepr(again) == sympy.srepr(expr)


def test_simplified_operations_are_rebuilt_not_simplified_again(monkeypatch):
    expr = sympy.Max(x + 1, IndexDiv(y, 2) * 3, 5)
    blob = schedule_cache.dumps(expr)
    assert b"_unevaluated" in blob

    def no_simplifying(*args, **kwargs):
        raise AssertionError("simplified again on load")

    monkeypatch.setattr(sympy.Max, "_find_localzeros", classmethod(no_simplifying))
    monkeypatch.setattr(sympy.Add, "flatten", classmethod(no_simplifying))
    monkeypatch.setattr(sympy.Mul, "flatten", classmethod(no_simplifying))
    assert schedule_cache.loads(blob) == expr


def _collector_state() -> bool:
    return gc.isenabled()


class Probe:
    """Records, as it is unpickled, whether the garbage collector is on."""

    def __reduce__(self):
        return _collector_state, ()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_while_loading_and_left_as_found(enabled):
    blob = pickle.dumps(Probe())
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        assert schedule_cache.loads(blob) is False
        assert gc.isenabled() is enabled
        with pytest.raises(pickle.UnpicklingError):
            schedule_cache.loads(b"not a pickle")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_a_loaded_schedule_reports_the_costs_it_was_made_with(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_AOT_CACHE", "0")  # the schedule cache alone

    def program(x, y):
        return torch.softmax(x.t() * 2 + y, -1)

    x, y = torch.randn(8, 6), torch.randn(6, 8)
    with ember.config.override(cache_dir=str(tmp_path)):
        made = explain_strict(program, x, y)
        torch._dynamo.reset()

        def not_again(*args, **kwargs):
            raise AssertionError("a loaded schedule's costs were worked out again")

        monkeypatch.setattr(cost, "kernel_cost", not_again)
        loaded = explain_strict(program, x, y)
    (graph,) = loaded.graphs
    assert "cached schedule" in graph.stage_seconds
    costs = [(k.name, k.bytes, k.flops) for k in graph.kernels]
    assert costs == [(k.name, k.bytes, k.flops) for k in made.graphs[0].kernels] and costs
