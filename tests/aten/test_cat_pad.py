"""`cat`, `stack`, `constant_pad_nd` and `slice_backward` lower to selections among clamped views (aten/lowerings/cat_pad.py), so they
fuse with their producers and consumers: compared with eager forward and backward on both code
generators (and with Triton on a GPU where one is present), and checked for what they cost (no
copy kernel, no ATen cat, each piece read once)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.tools.workloads import LlamaBlock
from tests.helpers import (
    ON_DEVICES,
    assert_close,
    assert_no_fallback,
    assert_not_worse,
    cpp_innermost_loop_vectorized,
    ember_compile,
    explain_strict,
    forward_backward,
    fresh_inputs,
    reports,
    repro,
)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def cat_mixed(a, b):  # pieces of different lengths, one computed, a reduction over the joined dim
    joined = torch.cat([a.sigmoid(), b, a * 3], dim=1)
    return joined.softmax(dim=1)


def cat_outer(a, b):  # along the outermost dim, realized as an output
    return torch.cat([a, b * 2], dim=0)


def pad_conv_like(x):  # zero padding on two dims, then a stencil that reads it at shifted windows
    p = F.pad(x, (1, 1, 1, 1))
    return p[:, :, :-2, :-2] + p[:, :, 1:-1, 1:-1] * 2 + p[:, :, 2:, 2:]


def pad_value_and_crop(x):
    return F.pad(x * 2, (2, -1, -1, 3), value=-0.5).tanh()


def slices_summed(x):  # the backward places each slice's gradient in zeros: slice_backward, lowered
    return (x[..., 1:5] * 2 + x[..., -4:]).sin()[:, 2:] + x[:, :2, :4].cos()


def stack_inner(a, b):  # a new dim inside, a computed piece beside an input; read back by a reduction
    return torch.stack([a.sigmoid(), b, a * 3], dim=1).softmax(dim=1)


def stack_last(a, b):  # a new innermost dim, realized as an output
    return torch.stack([a, b * 2], dim=-1)


PROGRAMS = {
    "stack_inner": (stack_inner, [(4, 5), (4, 5)]),
    "stack_last": (stack_last, [(3, 6), (3, 6)]),
    "slices_summed": (slices_summed, [(2, 4, 6)]),
    "rope": (rope, [(2, 3, 5, 8), (5, 8), (5, 8)]),
    "cat_mixed": (cat_mixed, [(4, 3), (4, 5)]),
    "cat_outer": (cat_outer, [(3, 6), (2, 6)]),
    "pad_conv_like": (pad_conv_like, [(2, 3, 5, 6)]),
    "pad_value_and_crop": (pad_value_and_crop, [(3, 4, 5)]),
}


@pytest.mark.parametrize("backend,device", ON_DEVICES)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_forward_backward_fp32(backend, device, name):
    fn, shapes = PROGRAMS[name]
    inputs = [torch.randn(s, device=device) for s in shapes]
    line = repro(program=name, backend=backend, device=device, dtype=torch.float32, inputs=inputs)
    compiled = ember_compile(fn, backend)
    with reports() as report:
        outs, grads = forward_backward(compiled, [], fresh_inputs(inputs), grad_seed=1, train=True)
    ref_outs, ref_grads = forward_backward(fn, [], fresh_inputs(inputs), grad_seed=1, train=True)
    assert_no_fallback(report, line)
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        assert_close(got, want, rtol=1e-5, atol=1e-6, what=name, line=line)
    names = [e for g in report.graphs for e in g.externs]
    assert not any(op in str(e) for op in ("cat", "stack", "pad") for e in names), f"ran as ATen: {names}\n{line}"


@pytest.mark.parametrize("backend,device", ON_DEVICES)
def test_rope_bf16_against_fp32_reference(backend, device):
    inputs = [torch.randn(s, device=device).to(torch.bfloat16) for s in PROGRAMS["rope"][1]]
    line = repro(program="rope", backend=backend, device=device, dtype=torch.bfloat16, inputs=inputs)
    compiled = ember_compile(rope, backend)
    got, _ = forward_backward(compiled, [], fresh_inputs(inputs), grad_seed=1, train=False)
    eager, _ = forward_backward(rope, [], fresh_inputs(inputs), grad_seed=1, train=False)
    ref, _ = forward_backward(rope, [], fresh_inputs(inputs, torch.float32), grad_seed=1, train=False)
    assert_not_worse(got[0], eager[0], ref[0], what="rope bf16", line=line)


def test_rope_is_one_kernel_reading_x_once():
    """rotate_half's cat is index math inside the RoPE kernel: x, cos and sin read once each
    (the clamped reads of x's halves fall in x's own footprint), the result written once."""
    x, cos, sin = torch.randn(2, 3, 16, 64), torch.randn(16, 64), torch.randn(16, 64)
    (graph,) = explain_strict(rope, x, cos, sin).graphs
    assert len(graph.kernels) == 1 and not graph.externs, graph
    assert graph.kernels[0].bytes == (2 * x.numel() + 2 * cos.numel()) * 4, graph


def test_cat_reads_each_piece_once():
    a, b = torch.randn(300, 8), torch.randn(200, 8)
    (graph,) = explain_strict(cat_outer, a, b).graphs
    assert len(graph.kernels) == 1 and not graph.externs, graph
    assert graph.kernels[0].bytes == 2 * (a.numel() + b.numel()) * 4, graph


def test_cat_of_many_pieces_runs_as_aten():
    """Every piece is evaluated at every position: past MAX_CAT_PIECES the select costs more
    than ATen's copy, and cat runs as an extern (with its producers' kernels in front)."""
    from ember.aten.lowerings.cat_pad import MAX_CAT_PIECES

    pieces = [torch.randn(2, 3) for _ in range(MAX_CAT_PIECES + 1)]
    fn = lambda *xs: torch.cat([x + 1 for x in xs], dim=0)
    (graph,) = explain_strict(fn, *pieces).graphs
    assert any("cat" in str(e) for e in graph.externs), graph
    with ember.config.override(backend="cpp"):
        torch.testing.assert_close(torch.compile(fn, backend="ember")(*pieces), fn(*pieces))


def test_llama_block_training_has_no_cat_extern():
    """LLaMA's RoPE (two rotate_half cats forward, their slices backward) fuses on the C++ path."""
    torch.manual_seed(0)
    model = LlamaBlock(32, 4, 64, 16)
    x = torch.randn(2, 16, 32)
    compiled = ember_compile(model, "cpp")
    line = "repro: LlamaBlock(32, 4, 64, 16) training on randn(2, 16, 32), cpp backend"
    with reports() as report:
        outs, grads = forward_backward(compiled, list(model.parameters()), fresh_inputs([x]), 2, train=True)
    ref_outs, ref_grads = forward_backward(model, list(model.parameters()), fresh_inputs([x]), 2, train=True)
    assert_no_fallback(report, line)
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        assert_close(got, want, rtol=1e-4, atol=1e-5, what="llama block", line=line)
    externs = [str(e) for g in report.graphs for e in g.externs]
    assert not any("cat" in e or "slice_backward" in e for e in externs), f"{externs}\n{line}"


def test_cat_of_buffers_into_an_extern_stays_aten():
    """Nothing would fuse: buffers in, a buffer out for a matrix product; ATen's copy it is."""

    def joined_matmul(q, k, v, w):
        return torch.cat([q, k, v], dim=-1) @ w

    q, k, v, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8), torch.randn(24, 5)
    blas = "cpp.gemm_template=0"  # the product ATen's extern (ember's C++ template would read the cat's buffer)
    (graph,) = explain_strict(joined_matmul, q, k, v, w, heuristics=blas).graphs
    assert "cat" in graph.externs and not graph.kernels, graph
    with_pointwise = explain_strict(
        lambda q, k, v, w: joined_matmul(q * 2, k, v, w), q, k, v, w, heuristics=blas
    ).graphs[0]
    assert "cat" not in with_pointwise.externs, with_pointwise


def test_zero_width_pad_between_convolutions_copies_nothing():
    """TF-style "same" padding that comes out to none (transformers' MobileNetV2 and EfficientNet pad before
    every convolution) is no copy kernel between two convolutions; a returned one, or one of a graph input,
    stays a new tensor, as eager's is."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 4, 3).eval()

    def same_padded(x):
        out = conv(F.pad(conv(x), (0, 0, 0, 0)))
        return out, F.pad(out, (0, 0, 0, 0)), F.pad(x, (0, 0, 0, 0))

    x = torch.randn(1, 4, 16, 16)
    with torch.no_grad():
        # (row-major convolutions, as eager's: their results are compared bit for bit)
        (graph,) = explain_strict(same_padded, x, channels_last=False).graphs
        # the two returned pads are copies (of the output and of the input); the one between the convolutions is not
        assert len(graph.kernels) == 2 and graph.externs.count("convolution") == 2, graph
        actual, expected = ember_compile(same_padded, "cpp", channels_last=False)(x), same_padded(x)
    for a, e in zip(actual, expected):
        assert_close(a, e, rtol=0, atol=0, what="zero-width pad", line=repro())
    assert actual[1].data_ptr() != actual[0].data_ptr() and actual[2].data_ptr() != x.data_ptr()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: ((a := x * 2), F.pad(a, (0, 0)).t()),  # a view of the pad returned beside its source
        lambda x: (F.pad((a := x * 2), (0, 0)).view(-1), a),
        lambda x: F.pad(x.t(), (0, 0)).t(),  # a pad of a view of the input, returned through a view
    ],
    ids=["view_beside_source", "flat_view_beside_source", "input_through_views"],
)
def test_zero_width_pad_that_escapes_is_a_new_tensor(fn):
    """Only a pad every reader of which is a convolution may share its input's storage: through views,
    returned, it would alias another output or the caller's input where eager gives a new tensor."""
    x = torch.randn(6, 5)
    with torch.no_grad():
        actual, expected = ember_compile(fn, "cpp")(x), fn(x)
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for a, e in zip(actual, expected):
        assert_close(a, e, rtol=0, atol=0, what="zero-width pad", line=repro())
    storages = [_storage(a) for a in actual]
    assert len(set(storages)) == len(storages) and _storage(x) not in storages, storages


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_cpp_padded_read_vectorizes(fmt):
    """A C++ kernel reads a padded view without clamping the positions its vector loop walks (clamped, every
    element was a gather: the pad before each depthwise convolution of MobileNetV2 took 5 to 12 times as
    long). Row-major, the loop walks the padded width: its load is conditional (its reader selects the
    padding away). Channels-last, it walks channels: the clamps on height and width are computed once per
    loop and the load is plain, since GCC 12 leaves a loop scalar where a load is conditional on a value the
    loop does not change."""

    def pad_bn_relu6(x, s, t):
        return F.pad((x * s + t).clamp(0, 6), (1, 1, 1, 1))

    x = torch.randn(1, 8, 12, 12).contiguous(memory_format=fmt)
    s, t = torch.randn(1, 8, 1, 1), torch.randn(1, 8, 1, 1)
    (graph,) = explain_strict(pad_bn_relu6, x, s, t).graphs
    (kernel,) = graph.kernels
    conditional, clamped_width = " ? in_" in kernel.source, "ember_min_index(11, (-1 + l2))" in kernel.source
    if fmt == torch.contiguous_format:  # the loop walks the width: read where in range, never clamped
        assert conditional and not clamped_width, kernel.source
    else:  # the loop walks channels: height and width are clamped once per loop, the load is plain
        assert "ember_min_index" in kernel.source and not conditional, kernel.source
    assert cpp_innermost_loop_vectorized(kernel.source), kernel.source
    with torch.no_grad():
        actual = ember_compile(pad_bn_relu6, "cpp")(x, s, t)
    assert_close(actual, pad_bn_relu6(x, s, t), rtol=1e-5, atol=1e-6, what="padded read", line=repro())


def test_packed_attention_backward_stacks_its_gradients_in_a_kernel():
    """A packed qkv projection (timm's ViT: one linear layer, its output unbound into q, k and v) has
    the attention backward's three gradients stacked into the projection's: the unbind (views), the stack
    and the bias gradient's sum are not ATen calls. (torch 2.11 sums a bfloat16 bias gradient with
    dtype=float32, which tests/aten/test_reduction_dtype.py covers; torch 2.13 on the CPU names no dtype.)"""

    class Attention(torch.nn.Module):
        def __init__(self, width: int, heads: int):
            super().__init__()
            self.heads, self.qkv = heads, torch.nn.Linear(width, 3 * width)

        def forward(self, x):
            b, n, c = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)

    torch.manual_seed(0)
    model = Attention(32, 4).to(torch.bfloat16)
    x = torch.randn(2, 6, 32, dtype=torch.bfloat16)
    line = "repro: packed-qkv attention (width 32, 4 heads) training on randn(2, 6, 32) bfloat16, cpp backend"
    params = list(model.parameters())
    with reports() as report:
        outs, grads = forward_backward(ember_compile(model, "cpp"), params, fresh_inputs([x]), 3, train=True)
    eager = forward_backward(model, params, fresh_inputs([x]), 3, train=True)
    reference = forward_backward(model.float(), list(model.parameters()), fresh_inputs([x], torch.float32), 3, True)
    model.to(torch.bfloat16)
    assert_no_fallback(report, line)
    for got, want, ref in zip(outs + grads, eager[0] + eager[1], reference[0] + reference[1]):
        assert_not_worse(got, want, ref, what="packed attention", line=line)
    externs = [str(e) for g in report.graphs for e in g.externs]
    assert not any(op in e for op in ("unbind", "stack", "sum") for e in externs), f"{externs}\n{line}"


def _padded_to_blocks(x):
    """Python's ceiling division and padding idioms over a size: a negated size divided and taken
    modulo, which the kernels (dividing toward zero) must not compute as C would."""
    n = x.shape[-1]
    blocks = -(-n // 16)
    padded = F.pad(x, (0, -n % 16))
    tail = x[..., 3:]  # (3 - n) % 8: never positive as n > 3, which Dynamo's ranges say
    return padded.view(*x.shape[:-1], blocks, 16).sum(-1) * 2, F.pad(tail, (0, -tail.shape[-1] % 8))


@pytest.mark.parametrize("backend,device", ON_DEVICES)
def test_padding_to_a_multiple_under_dynamic_sizes(backend, device):
    compiled = ember_compile(_padded_to_blocks, backend, dynamic=None)
    for n in (20, 37, 48, 53):  # the second size makes Dynamo's graph symbolic in n
        x = torch.randn(3, n, device=device)
        line = repro(backend=backend, device=device, n=n)
        with reports() as report:
            got = compiled(x)
        assert_no_fallback(report, line)
        for what, a, b in zip(("blocks", "tail"), got, _padded_to_blocks(x)):
            assert_close(a, b, rtol=1e-5, atol=1e-5, what=what, line=line)


def _chunked_by_true_division(x):
    """`math.ceil(n / 32)`, `int(n / 32)` and `math.floor(n / 32)` over a size: Python floats that
    Dynamo records as a true division rounded to an integer."""
    import math

    n = x.shape[0]
    chunks = math.ceil(n / 32)
    blocks = F.pad(x, (0, 0, 0, chunks * 32 - n)).view(chunks, 32, -1).sum(1)
    return blocks * 2, x[: int(n / 32) * 32] + 1, x[math.floor(n / 32) :] - 1


@pytest.mark.parametrize("backend,device", ON_DEVICES)
def test_sizes_from_a_rounded_true_division_under_dynamic_sizes(backend, device):
    compiled = ember_compile(_chunked_by_true_division, backend, dynamic=None)
    for n in (40, 70, 96, 129):
        x = torch.randn(n, 3, device=device)
        line = repro(backend=backend, device=device, n=n)
        with reports() as report:
            got = compiled(x)
        assert_no_fallback(report, line)
        for what, a, b in zip(("ceil", "int", "floor"), got, _chunked_by_true_division(x)):
            assert_close(a, b, rtol=1e-5, atol=1e-5, what=what, line=line)
