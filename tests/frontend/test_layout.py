"""Setting `channels_last`: CPU inference graphs run their convolutions on channels-last inputs
(frontend/layout.py).

Each case compares values and every output's strides with eager, and counts the conversions the compiled
graph makes: one into channels-last where the input is not, one back where an output (or a reader that
needs row-major strides) would otherwise change layout. Under freezing the prologue converts the weights.
Graphs the pass must leave alone (symbolic sizes, a read of strides, weights heavier than the activations)
still match eager."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from tests.helpers import assert_close, assert_no_fallback, ember_compile, randomize_bn, reports, repro

TOL = {"rtol": 1e-4, "atol": 1e-4}
TO_CHANNELS_LAST = "memory_format = torch.channels_last"
TO_ROW_MAJOR = "memory_format = torch.contiguous_format"


def conv_bn(cin: int, cout: int, k: int = 3, groups: int = 1, act: type[nn.Module] | None = nn.ReLU) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act()] if act else []))


class Residual(nn.Module):
    """Two convolution paths added (ResNet's basic block with a projection)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(conv_bn(4, 8), conv_bn(8, 8, act=None))
        self.shortcut = conv_bn(4, 8, k=1, act=None)

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class Inverted(nn.Module):
    """MobileNetV2's block: 1x1 expansion, depthwise 3x3, 1x1 projection, residual add."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.block = nn.Sequential(
            conv_bn(c, 4 * c, k=1, act=nn.ReLU6),
            conv_bn(4 * c, 4 * c, groups=4 * c, act=nn.ReLU6),
            conv_bn(4 * c, c, k=1),
        )

    def forward(self, x):
        return x + self.block(x)


class Head(nn.Module):
    """A stem with max pooling, then flatten and a linear layer: the flattening view needs row-major strides."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(conv_bn(3, 8), nn.MaxPool2d(2), conv_bn(8, 8))
        self.fc = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))


class Features(nn.Module):
    """Returns convolution results themselves: one of 1x1 spatial size, whose strides in its size-1 dims
    differ between the layouts, and a pooled [N, C] one."""

    def __init__(self):
        super().__init__()
        self.first = conv_bn(3, 8)
        self.last = nn.Conv2d(8, 6, 3, stride=12)

    def forward(self, x):
        y = self.first(x)
        return y, self.last(y), y.mean((2, 3))


@torch.library.custom_op("ember_layout_test::row_sums", mutates_args=())
def row_sums(x: torch.Tensor) -> torch.Tensor:
    """A custom op that, like many, assumes a row-major input."""
    if not x.is_contiguous():
        raise RuntimeError("row_sums: the input is not row-major")
    return x.view(x.shape[0], -1).sum(1)


@row_sums.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0])


class Strides(nn.Module):
    """Reads of a convolution result that see its layout: a custom op, and as_strided."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.conv = conv_bn(3, 8)

    def forward(self, x):
        y = self.conv(x)
        if self.how == "custom-op":
            return row_sums(y)
        return torch.as_strided(y, (2, 8, 3), (288, 36, 2)) + 1


class AtenOutputs(nn.Module):
    """Returns what roll and channel_shuffle make of a convolution result (ember runs both as ATen calls)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y.roll(1, 1), nn.functional.channel_shuffle(y, 2)


# name -> (model, input shape, input memory format, conversions to channels-last, conversions back, kernels
# or None). The inputs outnumber the 3x3 weights, which oneDNN would convert per call (layout.py).
CASES = {
    # the input converted; batch norm + ReLU one kernel per convolution, the last writing row-major
    "conv-bn-relu-stack": (lambda: nn.Sequential(conv_bn(3, 8), conv_bn(8, 8)), (2, 3, 12, 12), None, 1, 1, 3),
    "residual": (Residual, (2, 4, 12, 12), None, 1, 1, None),
    # (x + block(x): the add takes its first operand's row-major layout, as eager's does; the output is
    # still written through a conversion back, which the add's kernel computes directly)
    "depthwise-pointwise": (Inverted, (2, 8, 6, 6), None, 1, 1, None),
    "flatten-linear": (Head, (2, 3, 16, 16), None, 1, 1, None),
    # (the mean's kernel writes its own output through a conversion back too)
    "conv-outputs": (Features, (2, 3, 12, 12), None, 1, 3, None),
    "input-channels-last": (Inverted, (2, 8, 6, 6), torch.channels_last, 0, 0, None),
    # a custom op gets its input row-major again
    "custom-op": (lambda: Strides("custom-op"), (2, 3, 12, 12), None, 1, 1, None),
    # ATen ops whose fake kernels say row-major where the real ones keep a channels-last input's layout
    "aten-op-outputs": (AtenOutputs, (2, 3, 10, 10), None, 1, 2, None),
    # as_strided's elements depend on the strides it reads: the graph stays as it was
    "as-strided": (lambda: Strides("as-strided"), (2, 3, 12, 12), None, 0, 0, None),
}


def _inference_graph(report):
    (graph,) = [g for g in report.graphs if g.kind == "inference"]
    return graph


def _check(actual, expected, what: str, line: str) -> None:
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, **TOL, what=f"{what} output {i}", line=line)
        assert a.stride() == e.stride(), f"{what} output {i}: strides {a.stride()}, eager {e.stride()}\n{line}"


@pytest.mark.parametrize("name", CASES)
def test_convolutions_read_channels_last_inputs(name):
    make, shape, memory_format, to_cl, back, kernels = CASES[name]
    model = randomize_bn(make())
    x = torch.randn(shape)
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
    line = repro(case=name)
    with torch.no_grad(), reports() as report:
        _check(ember_compile(model, "cpp")(x), model(x), name, line)
    assert_no_fallback(report, line)
    graph = _inference_graph(report)
    code = graph.aten_graph
    assert code.count(TO_CHANNELS_LAST) == to_cl, f"conversions to channels-last\n{code}\n{line}"
    assert code.count(TO_ROW_MAJOR) == back, f"conversions back\n{code}\n{line}"
    if kernels is not None:
        assert len(graph.kernels) == kernels, f"{len(graph.kernels)} kernels\n{graph.host_source}\n{line}"


def test_freezing_converts_weights_once():
    """Under freezing the prologue converts the 3x3 weights to channels-last, and converts again when one of
    them is written in place."""
    from ember.frontend.freezing import FrozenGraph

    model = randomize_bn(nn.Sequential(conv_bn(3, 8), conv_bn(8, 8)))
    x = torch.randn(2, 3, 12, 12)
    compiled = ember_compile(model, "cpp", freezing=True, prepack=False)  # (packed weights: test_prepack.py)
    with torch.no_grad():
        with reports() as report:
            _check(compiled(x), model(x), "first call", repro())
        model[1][0].weight.mul_(-1)
        _check(compiled(x), model(x), "weight written in place", repro(change="weight.mul_(-1)"))
        model[0][1].running_var.mul_(2)  # folded into the first convolution's weight
        _check(compiled(x), model(x), "running_var written in place", repro(change="running_var.mul_(2)"))
        model[0][0].weight = nn.Parameter(torch.randn_like(model[0][0].weight))
        _check(compiled(x), model(x), "weight replaced", repro(change="a new weight"))
    code = _inference_graph(report).aten_graph
    assert code.count(TO_CHANNELS_LAST) == 1, f"the main graph converts the input alone\n{code}"
    gc.collect()
    (frozen,) = [obj for obj in gc.get_objects() if type(obj) is FrozenGraph]
    assert frozen.prologue.code.count(TO_CHANNELS_LAST) == 2, f"weights\n{frozen.prologue.code}"
    assert frozen.freezes == 4, frozen.freezes


def test_graphs_whose_weights_outnumber_their_inputs_stay_row_major():
    """oneDNN would convert the weights per call (and freezing would keep a second copy of them)."""
    model = randomize_bn(nn.Sequential(conv_bn(16, 16), conv_bn(16, 16)))
    x = torch.randn(1, 16, 4, 4)
    with torch.no_grad(), reports() as report:
        _check(ember_compile(model, "cpp")(x), model(x), "weights-heavy", repro())
    code = _inference_graph(report).aten_graph
    assert TO_CHANNELS_LAST not in code, code


def test_symbolic_sizes_leave_the_graph_as_it_was():
    model = randomize_bn(nn.Sequential(conv_bn(3, 8), conv_bn(8, 8, groups=8), nn.Flatten(), nn.Linear(8 * 25, 4)))
    compiled = ember_compile(model, "cpp", dynamic=True)
    with torch.no_grad(), reports() as report:
        for batch in (2, 3):
            x = torch.randn(batch, 3, 5, 5)
            _check(compiled(x), model(x), f"batch {batch}", repro(batch=batch))
    assert_no_fallback(report, repro())
    code = _inference_graph(report).aten_graph
    assert "aten.convolution" in code and TO_CHANNELS_LAST not in code, code


def _gpu_graph(dtype: torch.dtype, cast: bool, weight_read_again: bool = False) -> torch.fx.GraphModule:
    """ResNet-18's last stage at batch 1 (weights of 2.4M elements against inputs of 50K) as a GPU
    inference graph over fake CUDA tensors: the convolutions in `dtype`, their operands cast to it from
    float32 inside the graph where `cast` (as autocast's graphs do), else taken in `dtype` as they come;
    `weight_read_again`: the graph also returns a sum of the cast weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def conv(x, w):
        return torch.ops.aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)

    def block(x, w1, w2):
        if cast:
            x, w1, w2 = (t.to(dtype) for t in (x, w1, w2))
        y = torch.relu(conv(x, w1))
        out = torch.relu(conv(y, w2) + x).mean((2, 3))
        return (out, w1.sum() + w2.sum()) if weight_read_again else out

    source = torch.float32 if cast else dtype
    with FakeTensorMode():
        args = [
            torch.empty(s, device="cuda", dtype=source) for s in ((1, 512, 7, 7), (512, 512, 3, 3), (512, 512, 3, 3))
        ]
    return make_fx(block, tracing_mode="fake")(*args)


def _convolution_layouts(gm: torch.fx.GraphModule) -> list[tuple[bool, bool]]:
    from ember.frontend.layout import _is_channels_last

    convs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
    return [tuple(_is_channels_last(a.meta["val"]) for a in n.args[:2]) for n in convs]


def test_gpu_half_precision_convolutions_read_channels_last_operands():
    """cuDNN's bf16 and fp16 convolutions run channels-last: a GPU graph converts their inputs and weights.
    Weights that the graph casts cost nothing more (the cast's kernel writes its copy channels-last), so
    ResNet-18's weights, which outnumber its activations, do not decline the rewrite under autocast; the
    same graph fed bf16 weights as they are would copy them per call, and stays as it was; float32
    convolutions are left alone. The graph's output keeps eager's strides."""
    from ember.frontend.layout import to_channels_last

    for dtype in (torch.bfloat16, torch.float16):
        gm = _gpu_graph(dtype, cast=True)
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        old_stride = out.meta["val"].stride()
        assert to_channels_last(gm, convert_weights=True) == 2, gm.code
        assert _convolution_layouts(gm) == [(True, True), (True, True)], gm.code
        # each weight's conversion reads its cast alone, into which ember fuses it; nothing comes back to
        # row-major: the [N, C] mean has the same strides in either layout
        for conv in [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]:
            weight = conv.args[1]
            assert weight.target is torch.ops.aten.clone.default, gm.code
            assert weight.args[0].target is torch.ops.aten._to_copy.default, gm.code
            assert list(weight.args[0].users) == [weight], gm.code
        assert TO_ROW_MAJOR not in gm.code, gm.code
        assert out.meta["val"].stride() == old_stride

    plain = _gpu_graph(torch.bfloat16, cast=False)
    assert to_channels_last(plain, convert_weights=True) == 0, plain.code
    # A cast another op also reads is written row-major for it: converting it costs a copy per call again.
    shared = _gpu_graph(torch.bfloat16, cast=True, weight_read_again=True)
    assert to_channels_last(shared, convert_weights=True) == 0, shared.code
    assert TO_CHANNELS_LAST not in plain.code
    full = _gpu_graph(torch.float32, cast=False)
    assert to_channels_last(full, convert_weights=True) == 0 and TO_CHANNELS_LAST not in full.code
