"""Setting `freezing`: an inference graph's parameters and buffers become constants (frontend/freezing.py).

Batch norm after a convolution or linear layer is folded into its weight and bias (the compiled graph
has no batch-norm arithmetic left), results match eager, a replaced or in-place-modified parameter is
seen at the next call, and the computed-once tensors hold no second copy of the weights they did not
change."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from tests.helpers import assert_close, assert_no_fallback, ember_compile, randomize_bn, reports, repro

TOL = {"rtol": 1e-4, "atol": 1e-4}


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int = 1, bias: bool = False, relu: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, groups=groups, bias=bias)
        self.bn = nn.BatchNorm2d(cout)
        self.relu = relu

    def forward(self, x):
        y = self.bn(self.conv(x))
        return torch.relu(y) if self.relu else y


class LinearBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        return self.bn(self.fc(x))


class ConvBNConv(nn.Module):
    """Batch norm between two convolutions: no pointwise op reads its result."""

    def __init__(self):
        super().__init__()
        self.first = ConvBN(4, 8, relu=False)
        self.second = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.second(self.first(x))


# name -> (model, input shape, memory format, the op the batch norm follows, where it folds: "weight" into
# that op's weight and bias where nothing pointwise reads the result, else "epilogue": one multiply-add)
CASES = {
    "conv-bn-relu": (lambda: ConvBN(4, 8), (2, 4, 8, 8), torch.contiguous_format, "convolution", "epilogue"),
    "conv-bn": (lambda: ConvBN(4, 8, relu=False), (2, 4, 8, 8), torch.contiguous_format, "convolution", "weight"),
    "conv-bias-bn-channels-last": (
        lambda: ConvBN(4, 8, bias=True, relu=False),
        (2, 4, 8, 8),
        torch.channels_last,
        "convolution",
        "weight",
    ),
    "conv-bn-relu-channels-last": (lambda: ConvBN(4, 8), (2, 4, 8, 8), torch.channels_last, "convolution", "epilogue"),
    "conv-bn-conv": (ConvBNConv, (2, 4, 6, 6), torch.contiguous_format, "convolution", "weight"),
    "grouped-conv-bn": (
        lambda: ConvBN(8, 12, groups=4, relu=False),
        (2, 8, 6, 6),
        torch.contiguous_format,
        "convolution",
        "weight",
    ),
    "depthwise-conv-bn-channels-last": (
        lambda: ConvBN(8, 8, groups=8, relu=False),
        (2, 8, 6, 6),
        torch.channels_last,
        "convolution",
        "weight",
    ),
    "depthwise-conv-bn-relu": (
        lambda: ConvBN(8, 8, groups=8),
        (2, 8, 6, 6),
        torch.contiguous_format,
        "convolution",
        "epilogue",
    ),
    "linear-bn1d": (LinearBN, (5, 24), torch.contiguous_format, "addmm", "weight"),
}


def _inference_graph(report) -> str:
    graphs = [g for g in report.graphs if g.kind == "inference"]
    assert len(graphs) == 1, f"expected one inference graph, got {[g.kind for g in report.graphs]}"
    return graphs[0].aten_graph


@pytest.mark.parametrize("name", CASES)
def test_batch_norm_folds_into_the_op_before_it(name):
    make, shape, memory_format, op, fold = CASES[name]
    model = randomize_bn(make()).to(memory_format=memory_format)
    x = torch.randn(shape)
    if x.dim() == 4:
        x = x.to(memory_format=memory_format)
    line = repro(case=name)
    with torch.no_grad():
        expected = model(x)
        for freezing in (True, False):
            torch._dynamo.reset()
            with reports() as report:
                # (row-major: a conversion back to it after a convolution would read its result pointwise)
                # (unpacked: prepacked convolutions always fold batch norm into the weight, test_prepack.py)
                actual = ember_compile(model, "cpp", freezing=freezing, channels_last=False, prepack=False)(x)
            assert_no_fallback(report, line)
            assert_close(actual, expected, **TOL, what=f"{name} freezing={freezing}", line=line)
            code = _inference_graph(report)
            assert f"aten.{op}" in code, f"{op} missing from the compiled graph\n{code}\n{line}"
            # batch norm in eval mode is `(y - mean) * rsqrt(var + eps) * weight + bias` after decomposition:
            # frozen, none of it is left in the compiled graph; not frozen, the graph computes it per call.
            assert ("sqrt" in code) is not freezing, f"freezing={freezing}\n{code}\n{line}"
            if freezing:
                multiplies = code.count("aten.mul.Tensor")
                assert multiplies == (1 if fold == "epilogue" else 0), f"expected a {fold} fold\n{code}\n{line}"


class TwoConvs(nn.Module):
    """conv-bn-relu (folds into a multiply-add), conv-bn read by a mean (folds into the weight), and a large
    linear head that nothing folds into."""

    def __init__(self, c: int = 32):
        super().__init__()
        self.first = ConvBN(c, c)
        self.second = ConvBN(c, c, relu=False)
        self.head = nn.Linear(c, 2048)

    def forward(self, x):
        y = self.second(self.first(x))
        return y, self.head(y.mean((2, 3)))


def test_a_replaced_or_modified_parameter_is_never_stale(monkeypatch):
    from ember.frontend.freezing import FrozenGraph

    made = []  # every frozen graph made from here on: a second one would be a recompile
    init = FrozenGraph.__init__

    def recording_init(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(FrozenGraph, "__init__", recording_init)
    model = randomize_bn(TwoConvs(c=8))
    x = torch.randn(2, 8, 6, 6)
    # (row-major: channels-last convolutions would have the prologue read every 3x3 weight, frontend/layout.py)
    compiled = ember_compile(model, "cpp", freezing=True, channels_last=False, prepack=False)
    # change -> whether it changes a tensor the prologue read (the second conv's weight, which its batch norm
    # folds into, batch norms' tensors, the linear weight), so that the prologue runs again
    changes = {
        "first call": (lambda: None, True),
        "folded conv weight modified in place": (lambda: model.second.conv.weight.add_(0.25), True),
        "bn running_var modified in place": (lambda: model.second.bn.running_var.mul_(3), True),
        "folded conv weight replaced": (
            lambda: setattr(model.second.conv, "weight", nn.Parameter(torch.randn_like(model.second.conv.weight))),
            True,
        ),
        "bn weight replaced": (lambda: setattr(model.first.bn, "weight", nn.Parameter(torch.rand(8) + 0.5)), True),
        "unfolded conv weight modified in place": (lambda: model.first.conv.weight.mul_(-1), False),
        # (the product reads the weight's transpose, a view the prologue makes once)
        "linear weight copied into": (lambda: model.head.weight.copy_(torch.randn_like(model.head.weight)), True),
        "nothing changed": (lambda: None, False),
    }
    freezes = 0
    with torch.no_grad():
        previous = None
        for what, (change, refreezes) in changes.items():
            change()
            expected = model(x)
            actual = compiled(x)
            for a, e in zip(actual, expected):
                assert_close(a, e, **TOL, what=what, line=repro(change=what))
            if previous is not None and what != "nothing changed":
                assert not torch.equal(expected[1], previous), f"{what}: the change changed nothing in eager"
            previous = expected[1]
            freezes += refreezes
            assert [g.freezes for g in made] == [freezes], f"{what}: prologue runs"
    # And no other frozen graph is alive: a scan of the whole heap, once (per change it cost seconds late in a
    # session's run, whose heap is large).
    assert [g.freezes for g in _frozen_graphs()] == [freezes], "frozen graphs alive after the changes"


def _frozen_graphs() -> list:
    from ember.frontend.freezing import FrozenGraph

    gc.collect()
    return [obj for obj in gc.get_objects() if type(obj) is FrozenGraph]


def _tensor_bytes() -> int:
    """Bytes of the distinct CPU storages that live tensors hold (fake and meta tensors aside)."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: it reads __class__, which some module proxies answer with a warning
        if issubclass(kind, torch.Tensor) and not issubclass(kind, FakeTensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_frozen_weights_keep_no_second_copy_of_every_parameter():
    """Only the weight a batch norm folds into is copied (and per-channel vectors made); a call leaves
    nothing behind."""
    model = randomize_bn(TwoConvs())
    x = torch.randn(1, 32, 4, 4)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {
        b.untyped_storage().data_ptr() for b in model.buffers()
    }
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    folded = model.second.conv.weight.numel() * 4
    with torch.no_grad():
        expected = model(x)
        # (packed convolution weights are a second copy by design: setting `prepack`, test_prepack.py)
        compiled = ember_compile(model, "cpp", freezing=True, prepack=False)
        compiled(x)  # compiles, and runs the prologue once
        before = _tensor_bytes()
        actual = compiled(x)
        left = _tensor_bytes() - before - sum(a.untyped_storage().nbytes() for a in actual)
    for a, e, what in zip(actual, expected, ("features", "head")):
        assert_close(a, e, **TOL, what=what, line=repro())
    assert left <= 0, f"a call left {left} bytes behind"
    (frozen,) = _frozen_graphs()
    new = {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in frozen.constants}
    new = sum(n for ptr, n in new.items() if ptr not in params)
    # the folded weight; its bias, and the first batch norm's scale and shift (32 floats each)
    assert folded <= new <= folded + 3 * 32 * 4, f"frozen constants hold {new} bytes: folded weight {folded}"
    assert new < param_bytes / 4, f"frozen constants hold {new} bytes of {param_bytes} in parameters"


def test_folds_under_dynamic_shapes():
    """With a symbolic batch, the convolution's result is also read for its sizes (a flattening view):
    the folded convolution answers those reads."""
    model = nn.Sequential(
        ConvBN(3, 8), ConvBN(8, 8, relu=False), nn.Flatten(), nn.Linear(8 * 5 * 5, 4), nn.BatchNorm1d(4)
    )
    model = randomize_bn(model)
    compiled = ember_compile(model, "cpp", dynamic=True, freezing=True)
    with torch.no_grad(), reports() as report:
        for batch in (2, 3):
            x = torch.randn(batch, 3, 5, 5)
            assert_close(compiled(x), model(x), **TOL, what=f"batch {batch}", line=repro(batch=batch))
    assert_no_fallback(report, repro())
    code = _inference_graph(report)
    assert "sqrt" not in code and "aten.convolution" in code, code
