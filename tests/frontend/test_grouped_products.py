"""Under freezing, the C++ target's products of one input by frozen weights run as one product over the
weights concatenated, each reader reading its column slice (frontend/grouped_products.py). Each case runs
against eager, with oneDNN's packed product and with ATen's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember import config
from ember.backends import cpu_products
from ember.frontend import prepack
from tests.helpers import assert_close, assert_no_fallback, ember_compile, reports, repro

pytestmark = pytest.mark.skipif(not prepack.available(), reason="this torch has no oneDNN")

TOL = {"rtol": 1e-4, "atol": 1e-4}
LINEAR = "torch.ops.mkldnn._linear_pointwise.default"


class Block(nn.Module):
    """Attention's query, key and value over one normalized input, and a gated MLP's gate and up."""

    def __init__(self, width: int = 16, heads: int = 2, bias: bool = False, key_bias: bool | None = None):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.q, self.v = (nn.Linear(width, width, bias=bias) for _ in range(2))
        self.k = nn.Linear(width, width, bias=bias if key_bias is None else key_bias)
        self.gate, self.up = nn.Linear(width, 2 * width, bias=False), nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = x + a
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def _compiled_against_eager(model: nn.Module, x: torch.Tensor, line: str, calls=(("first call", None),), **options):
    torch._dynamo.reset()
    compiled = ember_compile(model, "cpp", freezing=True, **options)
    with torch.no_grad(), reports() as report:
        for what, change in calls:
            if change is not None:
                change()
            assert_close(compiled(x), model(x), **TOL, what=what, line=line)
    assert_no_fallback(report, line)
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    return graph.aten_graph


@pytest.mark.parametrize("packed", [True, False], ids=["onednn-packed", "aten"])
@pytest.mark.parametrize("bias", ["mm", "addmm", "mixed"])
def test_products_of_one_input_run_as_one(monkeypatch, packed, bias):
    """`mixed`: the key projection without a bias beside a query and value with one (Whisper's): one product
    whose bias holds zeros for the key's columns."""
    monkeypatch.setattr(cpu_products, "packed_is_faster", lambda *shape: packed)
    model = Block(bias=bias != "mm", key_bias=False if bias == "mixed" else None).eval()
    x = torch.randn(2, 5, 16)
    line = repro(program="LayerNorm -> q, k, v -> SDPA; LayerNorm -> gate, up -> SiLU * up -> down", packed=packed)
    write = ("weights written", lambda: (model.k.weight.mul_(-1), model.up.weight.mul_(0.5)))
    # oneDNN's packed products apply where ember's C++ GEMM template does not (here: the template off)
    options = {"heuristics": "cpp.gemm_template=0"} if packed else {}
    code = _compiled_against_eager(model, x, line, calls=(("first call", None), write), **options)
    products = (
        code.count(f"{LINEAR}(") if packed else code.count("aten.mm.default(") + code.count("aten.addmm.default(")
    )
    # q, k, v: one product; gate and up: one; down: its own
    assert products == 3, code
    assert code.count("aten.slice.Tensor(") >= 5, code


def test_off_by_the_heuristic_the_products_stay_apart(monkeypatch):
    monkeypatch.setattr(cpu_products, "packed_is_faster", lambda *shape: False)
    model = Block().eval()
    with config.override(heuristics="lower.group_frozen_products=0"):
        code = _compiled_against_eager(model, torch.randn(2, 5, 16), repro(group_frozen_products=0))
    assert code.count("aten.mm.default(") == 6, code


class Heads(nn.Module):
    """Two products of one input, each returned as it is (a view of it): their outputs keep eager's strides."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x):
        return self.a(x), self.b(x)


def _outputs_against_eager(model: nn.Module, x: torch.Tensor, line: str) -> str:
    """Each output of the frozen compiled model against eager's, values and strides; the graph's ATen code."""
    torch._dynamo.reset()
    with torch.no_grad(), reports() as report:
        actual, expected = ember_compile(model, "cpp", freezing=True)(x), model(x)
    assert_no_fallback(report, line)
    for got, want in zip(actual, expected):
        assert_close(got, want, **TOL, what="outputs", line=line)
        assert got.stride() == want.stride(), (got.stride(), want.stride(), line)
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    return graph.aten_graph


def test_products_whose_results_are_outputs_stay_apart(monkeypatch):
    monkeypatch.setattr(cpu_products, "packed_is_faster", lambda *shape: False)
    code = _outputs_against_eager(Heads().eval(), torch.randn(2, 5, 16), repro(program="return a(x), b(x)"))
    assert code.count("aten.addmm.default(") == 2, code


class ViewedOutputs(nn.Module):
    """Products of one input returned through a view and a transpose (a cross-attention's key and value cache),
    and one read through a flattening view, which a column slice cannot be viewed as."""

    def __init__(self):
        super().__init__()
        self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16)
        self.f, self.g = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x):
        b, t, _ = x.shape
        k, v = (p(x).view(b, t, 2, 8).transpose(1, 2) for p in (self.k, self.v))
        flat = self.f(x).reshape(-1)
        return k, v, flat.sum() + self.g(x).sum()


def test_outputs_and_flattened_views_keep_their_products_apart(monkeypatch):
    monkeypatch.setattr(cpu_products, "packed_is_faster", lambda *shape: False)
    line = repro(program="k(x).view.transpose, v(x).view.transpose, f(x).reshape(-1).sum() + g(x).sum()")
    code = _outputs_against_eager(ViewedOutputs().eval(), torch.randn(2, 5, 16), line)
    assert code.count("aten.addmm.default(") == 4, code


class FarApart(nn.Module):
    """Four products of one input: two, a long computation, two more (each decoder layer's cross-attention
    key and value over the encoder's output)."""

    def __init__(self):
        super().__init__()
        self.p = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(4))

    def forward(self, x, h):
        a = self.p[0](x) + self.p[1](x)
        for _ in range(16):
            h = torch.sin(h) * 1.01
        return a + h + self.p[2](x) * self.p[3](x)


def test_products_of_one_input_far_apart_are_grouped_in_runs(monkeypatch):
    monkeypatch.setattr(cpu_products, "packed_is_faster", lambda *shape: False)
    model = FarApart().eval()
    x, h = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    torch._dynamo.reset()
    with torch.no_grad(), reports() as report:
        actual, expected = ember_compile(model, "cpp", freezing=True)(x, h), model(x, h)
    line = repro(program="p0(x) + p1(x), 16 x sin(h) * 1.01, p2(x) * p3(x)")
    assert_no_fallback(report, line)
    assert_close(actual, expected, **TOL, what="output", line=line)
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    assert graph.aten_graph.count("aten.mm.default(") == 2, graph.aten_graph  # two runs of two
