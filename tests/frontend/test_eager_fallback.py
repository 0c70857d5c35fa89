"""A graph ember must run eagerly runs as Dynamo captured it: an optimizer's foreach ops stay foreach ops
(not AOTAutograd's per-tensor decomposition of them), with one warning naming the reason.

The failure is forced through a real seam: the setting `cxx` naming a compiler that does not exist, so the
C++ build of the graph fails (with a private cache folder, so no earlier build is found)."""

from __future__ import annotations

import warnings

import torch

from ember.frontend.backend import ember_backend
from tests.helpers import assert_close, reports, repro

BAD_CXX = "/nonexistent/g++"
SHAPES = [(5, 3), (7,), (2, 3, 4)]
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _capturing(into: list, cache_dir: str):
    """A torch.compile backend: ember with a broken C++ compiler; keeps what ember returned."""

    def backend(gm, example_inputs):
        options = {"cxx": BAD_CXX, "backend": "cpp", "strict": False, "cache_dir": cache_dir}
        compiled = ember_backend(gm, example_inputs, options=options)
        into.append(compiled)
        return compiled

    return backend


def _foreach_ops(compiled) -> tuple[int, int]:
    """(foreach calls, other calls) of the FX graph whose forward `compiled` is (Dynamo's graph)."""
    gm = getattr(compiled, "__self__", None)
    assert isinstance(gm, torch.fx.GraphModule), f"not a graph's forward: {compiled!r}"
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    foreach = sum("_foreach_" in getattr(n.target, "__name__", str(n.target)) for n in calls)
    return foreach, len(calls) - foreach


def _params():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_optimizer_step_falls_back_to_foreach_ops(tmp_path):
    """AdamW (foreach) whose graph cannot be built: 3 steps equal eager's, one warning naming the compiler,
    and what runs calls the `_foreach_*` ops (one per list operation) instead of one op per tensor."""
    eager_params, params = _params(), _params()
    eager_opt = torch.optim.AdamW(eager_params, lr=0.01, weight_decay=0.1, foreach=True)
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=True)
    seen: list = []
    step = torch.compile(opt.step, backend=_capturing(seen, str(tmp_path)))
    line = repro(cxx=BAD_CXX, optimizer="AdamW(foreach=True)", shapes=SHAPES, steps=3)
    with warnings.catch_warnings(record=True) as caught, reports() as report:
        warnings.simplefilter("always")
        for _ in range(3):
            eager_opt.step()
            step()
    for k, (p, e) in enumerate(zip(params, eager_params)):
        assert_close(p.detach(), e.detach(), **TOL, what=f"param {k}", line=line)
        for key, value in eager_opt.state[e].items():
            assert_close(opt.state[p][key], value, **TOL, what=f"state {key} of param {k}", line=line)
    messages = [str(w.message) for w in caught if str(w.message).startswith("ember")]
    assert len(messages) == 1 and BAD_CXX in messages[0], f"{messages}\n{line}"
    assert all(g.fallback and BAD_CXX in g.fallback for g in report.graphs), f"{report}\n{line}"
    step_graphs = [c for c in seen if _foreach_ops(c)[0]]
    assert step_graphs, f"no fallback graph calls a foreach op: {seen}\n{line}"
    foreach, other = _foreach_ops(step_graphs[-1])
    # AdamW's step is 19 list operations here; its per-tensor decomposition would be 3 ops per list
    # operation (plus a copy_ back per state tensor), and none of them a foreach op.
    assert foreach >= 10, f"{foreach} foreach ops, {other} other calls\n{line}"


class _Scaled(torch.nn.Module):
    """A training forward that also writes a buffer (a step counter)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.tanh(self.linear(x)) * self.calls


def test_training_forward_falls_back_to_dynamo_graph(tmp_path):
    """A forward graph that cannot be built runs Dynamo's graph under autograd: outputs, gradients and the
    buffer equal eager's over two calls."""
    torch.manual_seed(0)
    model, eager_model = _Scaled(), _Scaled()
    eager_model.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)
    seen: list = []
    compiled = torch.compile(model, backend=_capturing(seen, str(tmp_path)))
    line = repro(cxx=BAD_CXX, model="_Scaled", x=x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(x).sum().backward()
            eager_model(x).sum().backward()
    messages = [str(w.message) for w in caught if str(w.message).startswith("ember")]
    assert len(messages) == 1, f"{messages}\n{line}"
    assert all(isinstance(getattr(c, "__self__", None), torch.fx.GraphModule) for c in seen), f"{seen}\n{line}"
    for (name, p), e in zip(model.named_parameters(), eager_model.parameters()):
        assert_close(p.grad, e.grad, **TOL, what=f"grad of {name}", line=line)
    assert_close(model.calls, eager_model.calls, **TOL, what="buffer calls", line=line)
