"""Skinny products of one input in one launch (schedule/skinny.py, codegen/skinny_triton.py,
backends/skinny.py), through Triton's CPU interpreter: which products group, and that the grouped
kernel computes what eager's `mm` / `addmm` do, whole programs included (a decoding step of a small
HF Llama)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from ember import config
from ember.backends.skinny import SkinnyKernel, skinny_launch
from ember.backends.triton import TritonBackend
from ember.codegen.skinny_triton import SkinnyLaunch
from ember.schedule.skinny import SkinnyProducts, SkinnySpec
from tests.helpers import assert_close, assert_no_fallback, compiled_graph, ember_compile, reports, repro

TRITON = TritonBackend().target()  # the interpreter's


def _projections(x, wq, bq, wk, wv, wg, wu, wd):
    """A decoder layer's products at one token: q (with a bias), k, v, then gate and up over another input."""
    q, k, v = F.linear(x, wq, bq), F.linear(x, wk), F.linear(x, wv)
    h = torch.rms_norm(q[..., : k.shape[-1]] * k + v, [k.shape[-1]])
    mid = F.linear(h, wg)
    return F.linear(F.silu(mid) * F.linear(h, wu), wd)


def _inputs(rows: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    return [r(rows, 40), r(48, 40), r(48), r(24, 40), r(24, 40), r(72, 24), r(72, 24), r(24, 72)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_products_of_one_input_run_as_one_launch(rows, dtype):
    inputs = _inputs(rows, dtype)
    line = repro(rows=rows, dtype=dtype)
    out, graph = compiled_graph(_projections, inputs)
    assert graph.externs.count("skinny_products") == 2, f"{graph.externs}\n{line}"
    assert graph.externs.count("mm") == 1 and "addmm" not in graph.externs, f"{graph.externs}\n{line}"  # the lone down
    want = _projections(*inputs)
    # Each product rounds once, as eager's does: the same values, up to the fused kernels' rounding.
    ref = _projections(*[x.double() for x in inputs])
    err, eager_err = (out.double() - ref).abs().max().item(), (want.double() - ref).abs().max().item()
    assert err <= 2 * eager_err + 2**-8, f"ember {err} against eager's {eager_err}\n{line}"


def test_float32_more_rows_than_the_kernel_and_the_template_keep_their_own_calls():
    """float32 products (the tile's shared memory, TF32), products past the kernel's 16 rows however the
    setting reads, and every product under gemm=template keep their own calls."""
    inputs = _inputs(1, torch.float32)
    out, graph = compiled_graph(_projections, inputs)
    assert "skinny_products" not in graph.externs, graph.externs
    assert_close(out, _projections(*inputs), rtol=1e-5, atol=1e-5, what="f32", line=repro(dtype="f32"))
    inputs = _inputs(24, torch.bfloat16)
    with config.override(heuristics="skinny.max_rows=32"):
        out, graph = compiled_graph(_projections, inputs)
    assert "skinny_products" not in graph.externs, graph.externs
    assert_close(out, _projections(*inputs), rtol=2e-2, atol=2e-2, what="24 rows", line=repro(rows=24))
    inputs = _inputs(2, torch.bfloat16)
    out, graph = compiled_graph(_projections, inputs, gemm="template")
    assert "skinny_products" not in graph.externs, graph.externs


def test_larger_products_and_other_inputs_keep_their_own_calls():
    """17 rows is past the Target's bound; products of different inputs are not grouped."""
    inputs = _inputs(17, torch.bfloat16)
    out, graph = compiled_graph(_projections, inputs)
    assert "skinny_products" not in graph.externs, graph.externs
    assert_close(out, _projections(*inputs), rtol=2e-2, atol=2e-2, what="out", line=repro(rows=17))

    def two_inputs(x, y, w1, w2):
        return F.linear(x, w1) + F.linear(y, w2)

    args = [torch.randn(2, 8).half(), torch.randn(2, 8).half(), torch.randn(16, 8).half(), torch.randn(16, 8).half()]
    out, graph = compiled_graph(two_inputs, args)
    assert "skinny_products" not in graph.externs, graph.externs
    assert_close(out, two_inputs(*args), rtol=1e-2, atol=1e-2, what="two inputs", line=repro(case="two_inputs"))


def test_a_weight_computed_after_the_first_product_keeps_its_call():
    """The grouped call takes the first product's place: a product whose matrix is computed after it
    (not a view of something earlier) cannot join, and runs on its own."""

    def computed_weight(x, w1, w2, w3):
        a = x @ w1.t()
        w = (w2 * a.sum()).t()  # needs the first product
        return a.sum(-1, keepdim=True) + x @ w + x @ w3.t()

    args = [(torch.randn(*s) / 4).half() for s in ((3, 16), (8, 16), (8, 16), (8, 16))]
    out, graph = compiled_graph(computed_weight, args)
    assert graph.externs.count("skinny_products") == 1 and graph.externs.count("mm") == 1, graph.externs
    assert_close(out, computed_weight(*args), rtol=1e-2, atol=1e-2, what="out", line=repro(case="computed_weight"))


def test_the_setting_and_the_cpp_target_leave_products_alone():
    inputs = _inputs(1, torch.bfloat16)
    want = _projections(*inputs)
    with config.override(heuristics="skinny.max_rows=0"):
        out, graph = compiled_graph(_projections, inputs)
    assert "skinny_products" not in graph.externs, graph.externs
    assert_close(out, want, rtol=2e-2, atol=2e-2, what="off", line=repro(heuristics="skinny.max_rows=0"))
    with reports() as report:
        out = ember_compile(_projections, "cpp")(*inputs)
    assert not any("skinny" in e for g in report.graphs for e in g.externs), report.graphs
    assert_close(out, want, rtol=2e-2, atol=2e-2, what="cpp", line=repro(backend="cpp"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_the_kernel_at_edges(dtype):
    """Depth not a multiple of the step, columns not a multiple of the block, both bias shapes, and a
    row-major matrix beside transposed ones; bf16 results equal eager's (one rounding of an fp32 sum)."""
    spec = SkinnySpec(3, 300, (70, 33, 16), (True, True, False), dtype)
    kernel = SkinnyKernel(spec, SkinnyLaunch(32, 128, 4, 1), interpreted=True)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 300, generator=g).to(dtype)
    w0, w1 = torch.randn(70, 300, generator=g).to(dtype), torch.randn(33, 300, generator=g).to(dtype)
    b2 = torch.randn(300, 16, generator=g).to(dtype)  # row-major [K, N]
    bias0, bias1 = torch.randn(70, generator=g).to(dtype), torch.randn(1, 33, generator=g).to(dtype)
    got = kernel(a, w0.t(), w1.t(), b2, bias0, bias1)
    want = (torch.addmm(bias0, a, w0.t()), torch.addmm(bias1, a, w1.t()), a @ b2)
    for name, x, y in zip(("q", "k", "v"), got, want):
        assert x.shape == y.shape and x.is_contiguous(), (name, x.shape, x.stride())
        exact = a.double() @ (w0.t() if name == "q" else w1.t() if name == "k" else b2).double()
        err, eager_err = (x.double() - exact).abs().max().item(), (y.double() - exact).abs().max().item()
        assert err <= eager_err * 1.5 + 0.02, f"{name}: {err} against eager's {eager_err}"


def test_the_wide_tile_where_the_narrow_runs_many_programs():
    narrow = skinny_launch(SkinnySpec(1, 2048, (2048, 512, 512), (False,) * 3, torch.bfloat16), TRITON)
    wide = skinny_launch(SkinnySpec(1, 2048, (8192, 8192), (False,) * 2, torch.bfloat16), TRITON)
    h = TRITON.heuristics.skinny
    assert (narrow.block_n, narrow.block_k, narrow.stages) == (h.tile.xblock, h.tile.rblock, h.stages)
    assert (wide.block_n, wide.block_k, wide.stages) == (h.wide_tile.xblock, h.wide_tile.rblock, h.wide_stages)


def test_the_extern_pickles_and_runs_aten_until_built():
    """A cached schedule holds the extern target: it pickles, and called unbuilt it is eager's products."""
    spec = SkinnySpec(2, 8, (4, 6), (False, True), torch.float32)
    target = pickle.loads(pickle.dumps(SkinnyProducts(spec)))
    assert target.spec == spec
    a, w0, w1, bias = torch.randn(2, 8), torch.randn(8, 4), torch.randn(8, 6), torch.randn(6)
    got = target(a, w0, w1, bias)
    assert torch.equal(got[0], a @ w0) and torch.equal(got[1], torch.addmm(bias, a, w1))


def test_a_decoding_step_of_hf_llama():
    """One token through a small HF Llama (GQA): the query, key and value projections of each layer in
    one launch, the gate and up projections in another; logits match eager."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    ids = torch.tensor([[5, 17, 3]])

    def step(ids):
        return model(input_ids=ids[:, -1:], use_cache=False).logits

    with torch.no_grad():
        want = step(ids)
        with reports() as report:
            got = ember_compile(step, "triton")(ids)
    assert_no_fallback(report, repro(case="hf_llama_step"))
    externs = [e for g in report.graphs for e in g.externs]
    assert externs.count("skinny_products") == 2 * cfg.num_hidden_layers, externs
    assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, what="logits", line=repro(case="hf_llama_step"))
