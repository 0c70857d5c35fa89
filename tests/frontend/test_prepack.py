"""Setting `prepack`: under freezing, CPU convolutions run on weights packed once for oneDNN, with batch norm
folded into the packed weight and the activation fused (frontend/prepack.py).

Each case runs against eager; the compiled graph has oneDNN's convolution with the expected post-op in place
of ATen's, the prologue packs each weight once, and a weight written in place or replaced is packed again.
Depthwise convolutions are the C++ target's own (tests/aten/test_depthwise_convolution.py): here they are
left to oneDNN (`lower.depthwise_convolutions=0`), to be packed like the others."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from ember.backends import cpu_products
from ember.frontend import prepack
from tests.helpers import assert_close, assert_no_fallback, ember_compile, randomize_bn, reports, repro

pytestmark = pytest.mark.skipif(not prepack.available(), reason="this torch has no oneDNN")

TOL = {"rtol": 1e-4, "atol": 1e-4}
PACKED = "torch.ops.mkldnn._convolution_pointwise.default"
LIBRARY_DEPTHWISE = "lower.depthwise_convolutions=0"  # depthwise convolutions packed for oneDNN too


class ConvAct(nn.Module):
    """conv (stride, groups, bias as given) -> batch norm -> activation."""

    def __init__(self, cin, cout, act=None, groups=1, stride=1, bias=False, bn=True, k=3):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=bias)
        self.bn = nn.BatchNorm2d(cout) if bn else nn.Identity()
        self.act = act() if act else nn.Identity()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class Basic(nn.Module):
    """ResNet's basic block with a projection: the residual add and ReLU after two convolutions."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(ConvAct(4, 8, nn.ReLU), ConvAct(8, 8, stride=1))
        self.shortcut = ConvAct(4, 8, k=1)

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class TFPadded(nn.Module):
    """Explicit zero pads before the convolutions, as TensorFlow-style models write them (HF's MobileNetV2):
    equal widths (read unpadded by the packed convolution), zero widths, and stride 2's unequal [0, 1]."""

    def __init__(self):
        super().__init__()
        self.a = ConvAct(4, 8, nn.ReLU6, k=3)
        self.a.conv.padding = (0, 0)
        self.b = ConvAct(8, 8, nn.ReLU6, k=3, stride=2, groups=8)
        self.b.conv.padding = (0, 0)
        self.c = ConvAct(8, 4, k=1)

    def forward(self, x):
        y = self.a(nn.functional.pad(x, (1, 1, 1, 1)))
        y = self.b(nn.functional.pad(y, (0, 1, 0, 1)))
        return self.c(nn.functional.pad(y, (0, 0, 0, 0)))


# name -> (model, input shape, memory format of model and input, the post-ops of the packed convolutions)
CASES = {
    "conv-bn-relu": (lambda: ConvAct(4, 8, nn.ReLU), (2, 4, 8, 8), torch.contiguous_format, ["relu"]),
    "conv-bias-no-bn": (lambda: ConvAct(4, 8, bias=True, bn=False), (2, 4, 8, 8), torch.contiguous_format, ["none"]),
    "conv-bn-relu6-channels-last": (
        lambda: ConvAct(4, 8, nn.ReLU6, stride=2),
        (1, 4, 9, 9),
        torch.channels_last,
        ["hardtanh"],
    ),
    "depthwise-bn-silu": (lambda: ConvAct(8, 8, nn.SiLU, groups=8), (2, 8, 6, 6), torch.contiguous_format, ["swish"]),
    "grouped-bn-sigmoid": (
        lambda: ConvAct(8, 12, nn.Sigmoid, groups=4),
        (2, 8, 6, 6),
        torch.channels_last,
        ["sigmoid"],
    ),
    "conv-bn-gelu": (lambda: ConvAct(4, 8, nn.GELU), (2, 4, 8, 8), torch.contiguous_format, ["none"]),
    "basic-block": (Basic, (1, 4, 8, 8), torch.contiguous_format, ["relu", "none", "none"]),
    # 11x11: c's 1x1 reads 5x5 = 25 pixels, over lower.product_convolutions_max_pixels (a product below it)
    "tf-padded": (TFPadded, (1, 4, 11, 11), torch.channels_last, ["hardtanh", "hardtanh", "none"]),
}


def _frozen_graph():
    from ember.frontend.freezing import FrozenGraph

    gc.collect()
    (frozen,) = [obj for obj in gc.get_objects() if type(obj) is FrozenGraph]
    return frozen


def _post_ops(code: str) -> list[str]:
    """The attr argument of each packed convolution in the printed graph, in order."""
    ops = []
    for line in code.splitlines():
        if PACKED in line:
            ops.append(line.split("'")[1] if "'" in line else line.split('"')[1])
    return ops


@pytest.mark.parametrize("name", CASES)
def test_packed_convolutions_match_eager(name):
    make, shape, memory_format, post_ops = CASES[name]
    torch._dynamo.reset()
    model = randomize_bn(make()).to(memory_format=memory_format)
    x = torch.randn(shape).to(memory_format=memory_format)
    line = repro(case=name)
    with torch.no_grad(), reports() as report:
        expected = model(x)
        actual = ember_compile(model, "cpp", freezing=True, heuristics=LIBRARY_DEPTHWISE)(x)
    assert_no_fallback(report, line)
    assert_close(actual, expected, **TOL, what=name, line=line)
    assert actual.stride() == expected.stride(), f"strides {actual.stride()} vs eager's {expected.stride()}\n{line}"
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    code = graph.aten_graph
    assert "aten.convolution" not in code, f"an unpacked convolution is left\n{code}\n{line}"
    assert sorted(_post_ops(code)) == sorted(post_ops), f"post-ops\n{code}\n{line}"
    prologue = _frozen_graph().prologue.code
    assert prologue.count("mkldnn._reorder_convolution_weight.default(") == len(post_ops), (
        f"weights packed\n{prologue}\n{line}"
    )
    assert "sqrt" not in code, f"batch norm is left in the compiled graph\n{code}\n{line}"
    # equal-width zero pads become the convolution's padding; stride 2's [0, 1] stays a pad
    assert code.count("aten.constant_pad_nd.default(") == (name == "tf-padded"), f"pads\n{code}\n{line}"


def test_a_written_or_replaced_weight_is_packed_again():
    torch._dynamo.reset()
    model = randomize_bn(nn.Sequential(ConvAct(3, 8, nn.ReLU), ConvAct(8, 8, nn.ReLU6)))
    x = torch.randn(1, 3, 10, 10)
    compiled = ember_compile(model, "cpp", freezing=True)
    changes = {
        "first call": lambda: None,
        "weight written in place": lambda: model[1].conv.weight.mul_(-1),
        "running_var written in place": lambda: model[0].bn.running_var.mul_(2),
        "weight replaced": lambda: setattr(
            model[0].conv, "weight", nn.Parameter(torch.randn_like(model[0].conv.weight))
        ),
    }
    with torch.no_grad():
        for what, change in changes.items():
            change()
            assert_close(compiled(x), model(x), **TOL, what=what, line=repro(change=what))
    assert _frozen_graph().freezes == len(changes)


def test_prepack_off_and_float64_keep_aten_convolutions():
    """`prepack=False`, or a dtype oneDNN's packed path does not take here, leaves ATen's convolution."""
    for dtype, options in ((torch.float32, {"prepack": False}), (torch.float64, {})):
        torch._dynamo.reset()
        model = randomize_bn(ConvAct(4, 8, nn.ReLU)).to(dtype)
        x = torch.randn(2, 4, 8, 8, dtype=dtype)
        line = repro(dtype=dtype, **options)
        with torch.no_grad(), reports() as report:
            expected = model(x)
            actual = ember_compile(model, "cpp", freezing=True, **options)(x)
        assert_close(actual, expected, **TOL, what=str(dtype), line=line)
        (graph,) = [g for g in report.graphs if g.kind == "inference"]
        assert PACKED not in graph.aten_graph and "aten.convolution" in graph.aten_graph, f"{graph.aten_graph}\n{line}"


LINEAR = "torch.ops.mkldnn._linear_pointwise.default"


class MLP(nn.Module):
    """Linear layers with and without bias over a [batch, tokens, width] input, and a head tied to the first
    layer's weight (read transposed, as a language model's embedding and head share one)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        h = self.down(nn.functional.gelu(self.up(x)))
        return h, h @ self.down.weight


# Products outside ember's C++ GEMM template (here: the template off) choose between oneDNN and ATen.
NO_TEMPLATE = "cpp.gemm_template=0"


def test_matrix_products_on_packed_weights_match_eager_and_see_a_written_weight(monkeypatch):
    """Where oneDNN's packed product measures faster (here: said to, whatever this machine measures)."""
    monkeypatch.setattr(cpu_products, "packed_is_faster", lambda rows, k, n, bias: True)
    torch._dynamo.reset()
    model = MLP().eval()
    x = torch.randn(2, 5, 16)
    compiled = ember_compile(model, "cpp", freezing=True, heuristics=NO_TEMPLATE)
    with torch.no_grad(), reports() as report:
        for what, change in (("first call", lambda: None), ("weight written", lambda: model.up.weight.mul_(-1))):
            change()
            for a, e in zip(compiled(x), model(x)):
                assert_close(a, e, **TOL, what=what, line=repro(change=what))
    assert_no_fallback(report, repro())
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    code = graph.aten_graph
    # up and down read frozen weights; the last product's right operand is frozen too (the transposed head)
    assert code.count(f"{LINEAR}(") == 3 and "aten.addmm" not in code and "aten.mm" not in code, code
    prologue = _frozen_graph().prologue.code
    assert prologue.count("mkldnn._reorder_linear_weight.default(") == 3, prologue
    assert _frozen_graph().freezes == 2


def test_matrix_products_where_aten_measured_faster_stay_aten(monkeypatch):
    """A product whose packed form did not measure faster keeps ATen's addmm or mm, on the model's own weight."""
    asked = []
    monkeypatch.setattr(cpu_products, "packed_is_faster", lambda *shape: asked.append(shape) or shape[2] == 64)
    torch._dynamo.reset()
    model = MLP().eval()
    x = torch.randn(2, 5, 16)
    compiled = ember_compile(model, "cpp", freezing=True, heuristics=NO_TEMPLATE)
    with torch.no_grad(), reports() as report:
        for a, e in zip(compiled(x), model(x)):
            assert_close(a, e, **TOL, what="outputs", line=repro(packed="up only"))
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    code = graph.aten_graph
    # up ([10, 16] x [16, 64] + bias) and the tied head ([10, 16] x [16, 64]) are packed; down stays ATen's mm
    assert sorted(asked) == [(10, 16, 64, False), (10, 16, 64, True), (10, 64, 16, False)], asked
    assert code.count(f"{LINEAR}(") == 2 and code.count("aten.mm") == 1, code


def _frozen_against_eager(model: nn.Module, x: torch.Tensor, what: str, line: str):
    """`model(x)` compiled by the C++ backend under freezing: its result (values and strides) against eager's;
    returns the inference graph's report."""
    torch._dynamo.reset()
    with torch.no_grad(), reports() as report:
        expected = model(x)
        actual = ember_compile(model, "cpp", freezing=True)(x)
    assert_no_fallback(report, line)
    assert_close(actual, expected, **TOL, what=what, line=line)
    assert actual.stride() == expected.stride(), f"strides {actual.stride()} vs eager's {expected.stride()}\n{line}"
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    return graph


@pytest.mark.parametrize(
    "act,channels,product",
    [(nn.ReLU6, 32, True), (nn.SiLU, 32, False), (nn.ReLU, 16, False)],
    ids=["relu6-32-product", "silu-stays-onednn", "16-channels-stay-onednn"],
)
def test_pointwise_convolutions_as_blas_products(act, channels, product):
    """A 1x1 convolution over a channels-last input of at least `lower.product_convolutions_min_channels`
    channels (the C++ target's 32) is `addmm` over its [pixels, channels] view, batch norm folded into the
    weight and the activation left to ember's kernels; a SiLU or sigmoid keeps oneDNN's post-op."""
    model = randomize_bn(ConvAct(channels, 24, act, k=1)).to(memory_format=torch.channels_last)
    x = torch.randn(1, channels, 6, 5).to(memory_format=torch.channels_last)
    line = repro(act=act.__name__, channels=channels)
    graph = _frozen_against_eager(model, x, "1x1 convolution", line)
    assert ("aten.addmm" in graph.aten_graph) == product, f"{graph.aten_graph}\n{line}"
    assert (PACKED in graph.aten_graph) != product, f"{graph.aten_graph}\n{line}"
    assert "sqrt" not in graph.aten_graph, f"batch norm is left in the compiled graph\n{graph.aten_graph}\n{line}"


class SqueezeExcite(nn.Module):
    """EfficientNet's squeeze-and-excite: the spatial mean through a 1x1 reduce (SiLU) and expand (sigmoid)
    convolution, scaling the input's channels."""

    def __init__(self, channels: int, squeezed: int, bias: bool = True):
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1, bias=bias)
        self.expand = nn.Conv2d(squeezed, channels, 1, bias=bias)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(nn.functional.silu(self.reduce(s))))


@pytest.mark.parametrize(
    "shape,squeezed,bias",
    [
        ((1, 48, 7, 7), 4, True),  # pooled to [1, 48, 1, 1]
        ((2, 48, 5, 5), 4, False),  # a batch of two, no bias: mm
    ],
    ids=["one-image", "two-images-no-bias"],
)
def test_squeeze_and_excite_convolutions_over_one_pixel_are_products(shape, squeezed, bias):
    """Over a pooled [n, c, 1, 1] the 1x1 convolutions are BLAS products whatever their channels (4 here) and
    activation (SiLU, sigmoid): a oneDNN call would cost more than the work, and the activation over c values
    costs nothing."""
    model = SqueezeExcite(shape[1], squeezed, bias).to(memory_format=torch.channels_last)
    x = torch.randn(shape).to(memory_format=torch.channels_last)
    line = repro(
        program=f"squeeze-and-excite {shape[1]} -> {squeezed}, bias {bias}", x=f"f32{list(shape)} channels-last"
    )
    graph = _frozen_against_eager(model, x, "squeeze-and-excite", line)
    products = graph.aten_graph.count("aten.addmm") + graph.aten_graph.count("aten.mm")
    assert products == 2 and PACKED not in graph.aten_graph, f"{graph.aten_graph}\n{line}"


@pytest.mark.parametrize("pixels,product", [(16, True), (17, False)])
def test_a_1x1_convolution_over_more_than_the_few_pixels_keeps_onednn_for_its_silu(pixels, product):
    """The bound: a SiLU-activated 1x1 convolution of 8 channels is a product over 16 pixels, oneDNN's over 17."""
    model = randomize_bn(ConvAct(8, 8, nn.SiLU, k=1)).to(memory_format=torch.channels_last)
    x = torch.randn(1, 8, pixels, 1).to(memory_format=torch.channels_last)
    line = repro(program="1x1 conv 8 -> 8, batch norm, SiLU", x=f"f32[1, 8, {pixels}, 1] channels-last")
    graph = _frozen_against_eager(model, x, "1x1 convolution", line)
    assert (PACKED in graph.aten_graph) != product, f"{graph.aten_graph}\n{line}"


def test_a_valid_padded_convolution_after_an_explicit_pad_keeps_both_dims_padding():
    """`padding="valid"` reaches the graph as [0], one value for both dims: the explicit pad's widths (here
    the width's alone) join the convolution's padding in both dims, not in the first alone."""
    torch._dynamo.reset()

    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding="valid")

        def forward(self, x):
            return torch.relu(self.conv(nn.functional.pad(x, (1, 1, 0, 0))))

    # Channels-last throughout: the pad feeds the convolution directly (no layout copy between them).
    model = Padded().eval().to(memory_format=torch.channels_last)
    x = torch.randn(1, 4, 6, 7).to(memory_format=torch.channels_last)
    line = repro(program="pad (1, 1, 0, 0) then conv 3x3 padding='valid'", x="f32[1, 4, 6, 7] channels-last")
    with torch.no_grad(), reports() as report:
        expected = model(x)
        actual = ember_compile(model, "cpp", freezing=True)(x)
    assert_no_fallback(report, line)
    assert actual.shape == expected.shape, f"{tuple(actual.shape)} vs eager's {tuple(expected.shape)}\n{line}"
    assert_close(actual, expected, **TOL, what="padded convolution", line=line)
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    assert "constant_pad_nd" not in graph.aten_graph, f"the pad was not absorbed\n{graph.aten_graph}\n{line}"
