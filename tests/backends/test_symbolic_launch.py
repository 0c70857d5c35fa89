"""Kernels of symbolic sizes launch as directly as static ones: one binary, compiled ahead for
what holds at every size, and per call only the grid and the sizes computed from the bound
symbols. The GPU path is built here on the CPU: the warm-up jobs the backend compiles, and the
launch line the host program runs, executed against a recording launch."""

from __future__ import annotations

import pytest
import sympy
import torch
import triton

from ember import config
from ember.backends.static_launch import StaticLaunch
from ember.backends.triton import TritonBackend, _stand_in, _warmup_jobs
from ember.codegen.triton import render_triton
from ember.ir.sizes import index_symbol
from tests.helpers import reports
from tests.schedule.test_fusion import TRITON, G


def _symbolic_softmax_and_scale():
    s = index_symbol("s0")
    b = G()
    x = b.input(s, 48)  # rows: symbolic, 48 * s0 elements (divisible by 16 at every s0)
    m = b.reduce("max", x, (1,), keepdim=True)
    e = b.pw("exp", b.pw("sub", x, m))
    y = b.pw("truediv", e, b.reduce("sum", e, (1,), keepdim=True))
    z = b.pw("mul", b.input(s, 1), b.input(s, 1))  # s0 elements: not known divisible by 16
    return s, b.schedule(y, z).kernels


def test_a_symbolic_size_is_compiled_for_what_holds_at_every_size():
    s = index_symbol("s0")
    assert _stand_in(sympy.Integer(7)) == 7
    assert _stand_in(48 * s) == 1 << 32  # divisible by 16 for every s0: Triton may assume it
    assert _stand_in(s) == (1 << 32) + 1  # 64-bit, not 1, not divisible by 16
    assert _stand_in(3 * s + 16) % 16 != 0
    assert _stand_in(48 * s, narrow=True) == 1 << 30 and _stand_in(s, narrow=True) == (1 << 30) + 1  # 32-bit
    _, kernels = _symbolic_softmax_and_scale()
    rendered = {k.name: render_triton(k, TRITON) for k in kernels}
    assert all(r.guard for r in rendered.values())  # each has a 32-bit form, compiled ahead
    jobs = _warmup_jobs({name: None for name in rendered}, rendered)
    assert [j[0] for j in jobs] == list(rendered)  # every kernel compiles ahead, symbolic ones too
    for name, _, args, consts, _, _ in jobs:
        sizes = [a for a in args if isinstance(a, int)]
        assert any(1 << 30 <= v < 1 << 31 for v in sizes), (name, args)
        assert all(1 << 30 <= v < 1 << 31 or v == 48 for v in sizes), (name, args)  # a static length stays
        assert consts["XBLOCK"] == rendered[name].launch.xblock


class _Wide:
    """kernel[grid](...) of a 64-bit form, recorded."""

    def __init__(self, seen: list):
        self.seen = seen

    def __getitem__(self, grid):
        return lambda *args, **kw: self.seen.append(("wide", grid, args))


def test_a_symbolic_kernel_launches_directly_with_its_grid_computed_per_call():
    s, kernels = _symbolic_softmax_and_scale()
    with config.override(heuristics="launch.symbolic_int32_below=4800"):
        backend = TritonBackend()
    backend.build(kernels, None)
    seen = []
    for k in kernels:
        r = backend.rendered[k.name]
        codes = tuple("O" if p.kind == "buffer" else "i" for p in r.params) + ("i",) * (1 + bool(r.launch.rblock))
        codes += (None,) * (1 + bool(r.launch.rblock))  # XBLOCK, RBLOCK: constexprs
        backend.static[k.name] = StaticLaunch(None, 77, 4, 0, codes, 0, {})
        buffers = [f"b{i}" for i, p in enumerate(r.params) if p.kind == "buffer"]
        line = backend.launch_line(k, {"buffers": buffers, "maybe_unaligned": []})
        direct, _, wide = line.partition(" else ")
        assert "[(" not in direct and "triton.cdiv" not in direct, line  # not kernel[grid](...)
        assert wide.startswith(f"{k.name}_wide[("), line  # past the guard: the 64-bit form
        assert r.guard
        for rows in (1, 5, 99, 100, 1000, 5000):
            namespace = {"_static_launch": lambda *a: seen.append(a), "stream": 0, "s0": rows, "triton": triton}
            namespace.update({b: torch.empty(1) for b in buffers}, **{f"{k.name}_wide": _Wide(seen)})
            exec(line, namespace)  # noqa: S102 - the generated statement, as the host program runs it
            if any(e.subs(s, rows) >= 4800 for e in r.guard):  # an extent past the limit: 64-bit index math
                assert seen[-1][0] == "wide", (k.name, rows, line)
                continue
            per_program = r.launch.rows_per_program or r.launch.xblock
            xnumel = int(r.xnumel.subs(s, rows))
            assert seen[-1][1] == max(1, -(-xnumel // per_program)), (k.name, rows, line)
            assert xnumel in seen[-1][7]  # the sizes, computed from s0


@pytest.mark.parametrize("limit", [256, None])
def test_symbolic_kernels_match_eager_in_32_and_64_bit_forms(limit):
    # Rows of 12: extents of 36 to 1200 elements. With the limit at 256 the first sizes run the
    # 32-bit form and the later ones the 64-bit form; by default, all the 32-bit form.
    def f(x, w):
        y = torch.softmax(x * w, dim=-1) + x.t().contiguous().t()
        return torch.nn.functional.layer_norm(y, (12,)), y.sum(0)

    options = {"strict": True, "backend": "triton"}
    if limit:
        options["heuristics"] = f"launch.symbolic_int32_below={limit}"
    compiled = torch.compile(f, backend="ember", dynamic=True, options=options)
    w = torch.randn(12)
    with reports() as report:
        for rows in (3, 5, 17, 40, 100):
            x = torch.randn(rows, 12)
            for got, want in zip(compiled(x, w), f(x, w)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    hosts = "".join(g.host_source for g in report.graphs)
    assert "_wide[" in hosts and f"< {limit or (1 << 31) - (1 << 24)}" in hosts, hosts


def test_a_products_result_is_trusted_row_major_at_every_size():
    # ATen's mm/addmm return fresh row-major tensors: with symbolic sizes too, the host program
    # binds the result as it is, with no layout check per call.
    lin = torch.nn.Linear(16, 24)
    f = torch.compile(lin, backend="ember", dynamic=True)
    with reports() as report, config.override(strict=True, backend="cpp"):
        for rows in (3, 5, 17, 33, 40):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(f(x), lin(x), rtol=1e-5, atol=1e-5)
    # (the C++ target runs the linear layer's product as `mm`, its bias as its own add)
    hosts = [g.host_source for g in report.graphs if "= mm_" in g.host_source or "= addmm_" in g.host_source]
    assert hosts and all("_fix_layout(mm" not in h and "_fix_layout(addmm" not in h for h in hosts), hosts
    assert any("s" in h.split("def call")[1] for h in hosts)  # compiled with symbolic sizes
