"""Regressions found by the OpInfo sweep (`ember opinfo`), each compared with eager in strict mode.

Each case names the OpInfo op and sample it came from; strict mode turns a silent eager fallback
(ember's fail-safe catching its own error) into a failure.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers import ember_compile, repro


def _check(fn, *inputs, grad: bool = False, **fields):
    line = repro(**fields)
    eager_in = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) for x in inputs]
    comp_in = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) for x in inputs]
    expected = fn(*eager_in)
    actual = ember_compile(fn, "cpp")(*comp_in)
    assert actual.dtype == expected.dtype, line
    torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{m}\n{line}")
    if grad:
        cot = torch.randn_like(expected)
        ge = torch.autograd.grad(expected, [x for x in eager_in if x.requires_grad], cot)
        ga = torch.autograd.grad(actual, [x for x in comp_in if x.requires_grad], cot)
        for a, e in zip(ga, ge):
            torch.testing.assert_close(a, e, msg=lambda m: f"grad: {m}\n{line}")


def test_broadcast_to_0d_is_identity():
    # OpInfo broadcast_to sample 5: a 0-d tensor expanded to (); expand to its own shape.
    _check(lambda x: torch.broadcast_to(x, ()) * 2, torch.tensor(1.5), op="broadcast_to", shape=())


@pytest.mark.parametrize("dim", [0, -1, (0,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_sum_of_0d_over_dim(dim, dtype):
    # OpInfo sum samples 1, 2: sum of a 0-d tensor over dim 0 or -1 (was ZeroDivisionError: modulo by zero).
    x = torch.tensor(3).to(dtype)
    _check(lambda t: torch.sum(t, dim), x, op="sum", dim=dim, dtype=dtype)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.clamp(x, -1, 0),
        lambda x: torch.clamp(x, max=0),
        lambda x: torch.clamp(x, min=0),
        lambda x: torch.clamp_max(x, 0),
        lambda x: torch.clamp_min(x, 0.0),
        lambda x: torch.clamp(x, 0, 0),
    ],
    ids=["clamp(-1, 0)", "clamp(max=0)", "clamp(min=0)", "clamp_max(0)", "clamp_min(0.0)", "clamp(0, 0)"],
)
def test_clamp_bound_of_zero(fn):
    # OpInfo clamp: a bound of 0 was dropped (`or` instead of `is None`): a silent wrong answer.
    _check(fn, torch.randn(16), grad=True, op="clamp")


@pytest.mark.parametrize("dim", [None, 0, -1])
def test_var_of_0d(dim):
    # OpInfo var / var_mean / std on 0-d inputs with dim=0: was ZeroDivisionError in the lowering.
    _check(lambda t: torch.var(t, dim), torch.tensor(2.5), op="var", dim=dim)


@pytest.mark.parametrize("correction", [0, 1, 1.0, 0.3, 2, 7])
def test_var_float_correction(correction):
    # OpInfo std/var/var_mean samples: a float correction made a float size expression (ember fell back
    # with "index expression 4.000"); a correction above the count must give eager's nan (max(0, N - c)).
    x = torch.randn(4, 5)
    _check(lambda t: torch.var(t, 1, correction=correction), x, grad=True, op="var", correction=correction)
    _check(lambda t: torch.std(t, 1, correction=correction), x, op="std", correction=correction)
    _check(lambda t: torch.var_mean(t, 0, correction=correction)[0], x, op="var_mean", correction=correction)


def test_cosine_similarity_broadcast_row_stored_per_element():
    # OpInfo nn.functional.cosine_similarity sample 7 (gradients): b [2, 1, 3] broadcast along the reduced
    # dim -2 makes b / max(||b||, eps) constant along the row, but the forward saves it at the full
    # [2, 2, 3] shape; that store was rendered outside the row loop (g++: 'l2' was not declared).
    a, b = torch.randn(1, 2, 3), torch.randn(2, 1, 3)
    _check(lambda x, y: torch.nn.functional.cosine_similarity(x, y, dim=-2), a, b, grad=True, op="cosine_similarity")


@pytest.mark.parametrize("shape", [(), (5,), (4, 3)])
def test_one_hot_with_its_range_checks(shape):
    # OpInfo nn.functional.one_hot int64 samples 1, 3, 5 (num_classes=10): the graph calls _assert_async,
    # an extern that returns nothing; the host program indexed its (absent) output (IndexError).
    x = torch.randint(0, 10, shape)
    _check(lambda t: torch.nn.functional.one_hot(t, num_classes=10), x, op="one_hot", shape=shape)


def test_one_hot_out_of_range_raises_as_eager_does():
    compiled = ember_compile(lambda t: torch.nn.functional.one_hot(t, num_classes=3), "cpp")
    with pytest.raises(RuntimeError, match="smaller than num_classes"):
        compiled(torch.tensor([0, 1, 5]))


# -- found by the GPU sweep (Triton on an H100) ---------------------------------------------------


@pytest.mark.parametrize(
    "fn", [lambda a, b: a + b, lambda a, b: torch.add(a, b, alpha=True), lambda a, b: b.__radd__(a)]
)
def test_bool_add_is_logical_or(fn):
    # OpInfo add / __radd__ bool: Triton's 1-bit add wraps (True + True = False) where eager ors. The
    # interpreter and C++ both or, so the check is the kernel's source: no 1-bit `+` is left.
    from tests.helpers import explain_strict

    a = torch.tensor([True, True, False, False, True])
    b = torch.tensor([True, False, True, False, True])
    _check(fn, a, b, op="add", dtype=torch.bool)
    report = explain_strict(fn, a, b, backend="triton")
    (kernel,) = report.kernels
    assert not re.search(r"tmp\d+ \+ tmp\d+", kernel.source) and " | " in kernel.source, kernel.source


def test_data_dependent_shape_promised_fixed_is_declined():
    # OpInfo index_fill float32 sample 5 (GPU, torch 2.11): the backward's `_unique` had a fake
    # result of fixed size (5,) where the real one had 3 elements; the host program checked the
    # extern's result and raised. A fixed promise for a data-dependent op is declined up front.
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.aten.importer import import_graph
    from ember.aten.registry import GraphUnsupported

    def f(x, idx):
        values = torch.ops.aten._unique(idx, False)[0]
        return x.index_select(1, values).sum()

    x, idx = torch.randn(5, 5), torch.tensor([1, 3, 1, 3, 2])
    gm = make_fx(f)(x, idx)  # real tensors: every meta shape is fixed, as torch 2.11's fake on CUDA made it
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = {"x_1": x, "idx_1": idx}[node.name]
    with pytest.raises(GraphUnsupported, match="data-dependent output shape"):
        import_graph(gm, torch.device("cpu"))


@pytest.mark.parametrize("contract", [True, False])
def test_fp_contract_setting_reaches_the_triton_launch(contract):
    # OpInfo layer_norm float32, gradients of one-element rows (GPU): with FMA contraction the product
    # inside the row's mean and the one after it round differently (2.3e-5 where eager gives 0);
    # `fp_contract=False` compiles without it. The interpreter ignores the flag: the check is that it
    # reaches the launch, and that the gradient is right either way here.
    from tests.helpers import explain_strict

    x = torch.randn(3, 1, requires_grad=True)
    fn = lambda t: torch.nn.functional.layer_norm(t, (1,)).sum()
    report = explain_strict(fn, x, backend="triton", fp_contract=contract)
    host = "\n".join(g.host_source for g in report.graphs)
    assert f"enable_fp_fusion={contract}" in host, host
    _check(lambda t: torch.nn.functional.layer_norm(t, (1,)), x.detach(), grad=True, op="nn.functional.layer_norm")


@pytest.mark.parametrize("name", ["logical_and_", "logical_or_"])
def test_inplace_logical_with_a_0d_operand_on_triton(name):
    # OpInfo logical_and_/logical_or_ samples 1, 3 (`ember opinfo --inplace`, Triton's interpreter): a 0-d
    # tensor's load is a scalar boolean there, which the interpreter cannot `&`/`|` with a block.
    x, other = torch.tensor([0.0, 1.5, -2.0, 0.0, 3.0]), torch.tensor(0.0)
    for value in (0.0, 3.6):
        eager_x, comp_x = x.clone(), x.clone()
        fn = lambda t, o: getattr(t, name)(o)
        torch._dynamo.reset()
        ember_compile(fn, "triton")(comp_x, other.fill_(value))
        fn(eager_x, other)
        torch.testing.assert_close(comp_x, eager_x, msg=lambda m, v=value: f"{m}\n{repro(op=name, other=v)}")
