"""`args["same"]` (codegen/host.py): per kernel buffer, the first of the kernel's buffer names bound
to the same tensor object. Launches that pass each tensor once (table kernels) build every buffer's
address from it, so a name said to be another's tensor must be that very object. Checked at run
time: every launch line of the C++ backend is prefixed with an assertion of it, over programs with
inputs written in place, buffers reusing dead ones and aliases."""

from __future__ import annotations

import copy

import pytest
import torch

from ember.backends.cpp import CppBackend
from ember.tools.workloads import LlamaBlock
from tests.helpers import assert_close, ember_compile


@pytest.fixture
def checked_launches(monkeypatch):
    seen = {"launches": 0, "merged": 0}
    launch_line = CppBackend.launch_line

    def checked(self, kernel, args):
        line = launch_line(self, kernel, args)
        pairs = [(b, s) for b, s in zip(args["buffers"], args["same"]) if b != s]
        assert all(s in args["buffers"][: args["buffers"].index(b)] for b, s in pairs), args
        seen["launches"] += 1
        seen["merged"] += len(pairs)
        check = " and ".join(f"{b} is {s}" for b, s in pairs)
        return f"assert {check}, {str(pairs)!r}; {line}" if pairs else line

    monkeypatch.setattr(CppBackend, "launch_line", checked)
    return seen


def _momentum(params, grads, states):
    for p, g, m in zip(params, grads, states):
        m.mul_(0.9).add_(g, alpha=0.1)
        p.add_(m, alpha=-0.05)


def test_inputs_written_in_place_are_one_tensor_each(checked_launches):
    sizes = [(7,), (33,), (4, 9), (64,)]
    tensors = [[torch.randn(s) for s in sizes] for _ in range(3)]
    want = [[t.clone() for t in ts] for ts in tensors]
    compiled = ember_compile(_momentum, "cpp")
    for _ in range(2):
        compiled(*tensors)
        _momentum(*want)
    line = f"repro: momentum step over {sizes}, cpp, every launch asserting args['same']"
    for got, ref in zip(tensors[0] + tensors[2], want[0] + want[2]):
        assert_close(got, ref, rtol=1e-6, atol=1e-6, what="updated tensor", line=line)
    assert checked_launches["launches"] and checked_launches["merged"], (checked_launches, line)


def test_a_llama_blocks_buffers_are_merged_only_where_one_tensor(checked_launches):
    """Inference over a LLaMA block: buffers reusing dead ones, aliases of extern outputs, a residual
    add written in place of its input."""
    torch.manual_seed(0)
    model, x = LlamaBlock(64, 4, 172, 32), torch.randn(2, 32, 64)
    with torch.no_grad():
        want = model(x)
        got = ember_compile(copy.deepcopy(model), "cpp")(x)
    line = "repro: LlamaBlock(64, 4, 172, 32) on randn(2, 32, 64), cpp, every launch asserting args['same']"
    assert_close(got, want, rtol=1e-4, atol=1e-5, what="llama block output", line=line)
    assert checked_launches["launches"] and checked_launches["merged"], (checked_launches, line)
