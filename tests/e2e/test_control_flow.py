"""torch.cond and torch.while_loop: each branch, condition and body compiled as its own ember graph
and run from the host program; forward, training through cond, and loops with a fixed or a
data-dependent trip count, against eager. Under CUDA graphs such a step is a named refusal."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops import while_loop

from ember.report import collecting
from ember.runtime import cudagraphs as cg
from tests.helpers import assert_close, ember_compile, repro


def cond_program(x):
    return torch.cond(x.sum() > 0, lambda x: x.sin() * 2, lambda x: x.cos() + 1, (x,))


def counted_loop(x):
    return while_loop(lambda i, x: i < 5, lambda i, x: (i + 1, x * 2 + 1), (torch.tensor(0), x))[1]


def data_dependent_loop(x):
    return while_loop(lambda x: x.abs().sum() < 100, lambda x: (x * 2 + 0.5,), (x,))[0]


CASES = {
    # name: (program, inputs: each branch / a loop that runs and one that does not)
    "cond": (cond_program, lambda: [torch.rand(8) + 0.1, -torch.rand(8) - 0.1]),
    "while_counted": (counted_loop, lambda: [torch.randn(8)]),
    "while_data_dependent": (data_dependent_loop, lambda: [torch.randn(8), torch.full((8,), 50.0)]),
}


def _check(name, backend, dynamic=False):
    fn, inputs = CASES[name]
    compiled = ember_compile(fn, backend, dynamic=dynamic)
    with collecting() as report:
        for x in inputs():
            line = repro(name=name, backend=backend, dynamic=dynamic, x=x)
            assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5, what=name, line=line)
    subgraphs = [g for g in report.graphs if g.kind != "inference"]
    # Each branch or body is a graph of its own, with its own kernels, none run eagerly.
    assert subgraphs and all(g.kernels and g.fallback is None for g in subgraphs), f"{report}\n{line}"


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_subgraphs_match_eager(name):
    _check(name, "cpp")


@pytest.mark.parametrize("name", ["cond", "while_counted"])
def test_dynamic_sizes(name):
    _check(name, "cpp", dynamic=True)


@pytest.mark.parametrize("name", ["cond", "while_counted"])
def test_through_triton_interpreter(name):
    _check(name, "triton")


def test_training_through_cond_matches_eager():
    w = torch.randn(8, requires_grad=True)

    def fn(x):
        return torch.cond(x.sum() > 0, lambda x: (x * w).sin() * 2, lambda x: x.cos() + w, (x,))

    compiled = ember_compile(fn, "cpp")
    for x in [torch.rand(8) + 0.1, -torch.rand(8) - 0.1]:  # each branch, forward and backward
        line = repro(program="cond training", x=x)
        x.requires_grad_(True)
        got = compiled(x)
        got_grads = torch.autograd.grad(got.pow(2).sum(), (x, w))
        want = fn(x)
        want_grads = torch.autograd.grad(want.pow(2).sum(), (x, w))
        assert_close(got, want, rtol=1e-5, atol=1e-5, what="output", line=line)
        for g, e, what in zip(got_grads, want_grads, ("x.grad", "w.grad")):
            assert_close(g, e, rtol=1e-5, atol=1e-5, what=what, line=line)


def _aten_graph(fn, x) -> torch.fx.GraphModule:
    """The inference ATen graph AOTAutograd makes of fn (no compile of ember's)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.compile(fn, backend=aot_autograd(fw_compiler=keep, inference_compiler=keep))(x)
    return graphs[0]


@pytest.mark.parametrize(
    "name, reason",
    [
        ("cond", "torch.cond reads its predicate, a device tensor, on the host"),
        ("while_counted", "torch.while_loop reads its condition on the host"),
    ],
)
def test_host_control_flow_is_a_named_refusal_under_cudagraphs(name, reason):
    fn, inputs = CASES[name]
    found = cg.refusals(cg.capture_facts(_aten_graph(fn, inputs()[0]), torch.device("cpu")), "cpu")
    assert any(reason in r for r in found), f"{found}\n{repro(name=name)}"


def test_operand_in_another_layout_than_recorded():
    """A branch's operand computed around the cond (x.t() + 1: column-major in eager, row-major where
    ember computes it under dynamic sizes) reaches the branch in the layout its kernels index."""

    def fn(x):
        y = x.t() + 1
        return torch.cond(x.sum() > 0, lambda y: y[0] * 2 + y.sum(0), lambda y: y[1] - 1, (y,))

    compiled = ember_compile(fn, "cpp", dynamic=True)
    for x in [torch.rand(3, 5), -torch.rand(4, 6)]:
        line = repro(program="cond over x.t() + 1", x=x)
        assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5, what="cond", line=line)
