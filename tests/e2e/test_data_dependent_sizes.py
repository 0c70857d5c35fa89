"""Sizes that depend on data (a boolean mask, nonzero, unique, one-argument where), captured by Dynamo
with `capture_dynamic_output_shape_ops`: the op runs as an ATen call, its result's size binds an
unbacked symbol in the host program, and the kernels after it take that size at run time. Against
eager, including empty results."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from ember.report import collecting
from tests.helpers import assert_close, ember_compile, repro

PROGRAMS = {
    "mask": lambda x: x[x > 0] * 2,
    "nonzero": lambda x: torch.nonzero(x > 0) + 1,
    "unique": lambda x: torch.unique(x.round()) * 2,
    "where": lambda x: torch.where(x > 0)[0] + 1,
    "mask_reduced": lambda x: x[x > 0].exp().sum() + x[x > 0].pow(2).sum(),
    "mask_rows": lambda x: x.view(4, 5)[x.view(4, 5)[:, 0] > 0].softmax(-1),
    "where_2d": lambda x: torch.stack(torch.where(x.view(4, 5) > 0)) * 2,
}

INPUTS = [lambda: torch.randn(20) * 3, lambda: -torch.rand(20)]  # some kept; none kept (empty results)


CASES = [(name, "cpp") for name in PROGRAMS] + [("mask", "triton"), ("mask_reduced", "triton")]


@pytest.mark.parametrize("name, backend", CASES)
def test_matches_eager(name, backend):
    fn = PROGRAMS[name]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = ember_compile(fn, backend)
        with collecting() as report:
            for make in INPUTS:
                x = make()
                line = repro(name=name, backend=backend, x=x)
                got, want = compiled(x), fn(x)
                assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}\n{line}"
                assert_close(got, want, rtol=1e-5, atol=1e-5, what=name, line=line)
    domains = [k.domain for g in report.graphs for k in g.kernels]
    assert any("u0" in d for d in domains), f"no kernel over the data-dependent size\n{report}\n{line}"


def test_range_constraint_on_a_data_dependent_size_is_a_host_check():
    """`sym_constrain_range_for_size` (recorded by some torch versions beside nonzero) checks the size
    on the host after the extern that binds it, and a size outside the range raises eager's way."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember import config
    from ember.pipeline import compile_graph

    def fn(x, high):
        rows = torch.nonzero(x > 0)
        torch.ops.aten.sym_constrain_range_for_size.default(rows.size(0), min=0, max=high)
        return rows + 1

    x = torch.randn(16)
    with config.override(strict=True, backend="cpp"):
        within = compile_graph(make_fx(lambda x: fn(x, 16), tracing_mode="symbolic")(x), [x], "inference")
        beyond = compile_graph(make_fx(lambda x: fn(x, 2), tracing_mode="symbolic")(x), [x], "inference")
    assert torch.equal(within([x])[0], fn(x, 16)), repro(program="nonzero within its range")
    with pytest.raises(RuntimeError, match="is not within"):
        beyond([torch.ones(16)])
