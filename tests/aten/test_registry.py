"""The lowering registry (aten/registry.py): an op has one lowering, found by overload or packet, and
a second registration for an op is refused at import, naming both functions, with nothing changed."""

from __future__ import annotations

import pytest
import torch

import ember.aten.importer  # noqa: F401  (imports the lowerings, which fill the registry)
from ember.aten.registry import lowering, lowering_for

aten = torch.ops.aten


def test_lowering_found_by_overload_and_by_packet():
    by_packet = lowering_for(aten.exp.default)  # registered for the packet aten.exp
    assert by_packet is not None and by_packet is lowering_for(aten.exp)
    assert lowering_for(aten.var.correction) is not None  # registered for the packet, declines others
    assert lowering_for(aten.nonzero.default) is None  # no lowering: runs as an ATen call


def test_second_lowering_for_an_op_is_refused_and_changes_nothing():
    original = lowering_for(aten.exp)
    unregistered = object()  # a target listed before the taken one must not be registered either

    def another_exp(ctx, node):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match=r"exp has a lowering already \(ember\.aten\..*_unary\).*another_exp"):
        lowering(unregistered, aten.exp)(another_exp)
    assert lowering_for(aten.exp) is original
    assert lowering_for(unregistered) is None
