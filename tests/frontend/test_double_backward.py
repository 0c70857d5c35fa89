"""A gradient penalty through an ember-compiled module: the first grad (create_graph=True) runs and
matches eager, and the double backward is refused with AOTAutograd's own reason, as under Inductor,
not with a hint about donated buffers."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ember_compile


def test_gradient_penalty_first_grad_runs_and_double_backward_says_why():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    compiled = ember_compile(model, "cpp")
    x = torch.randn(3, 4, requires_grad=True)
    (want,) = torch.autograd.grad(model(x).sum(), x)
    (grad,) = torch.autograd.grad(compiled(x).sum(), x, create_graph=True)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
    penalty = (grad.norm(2, dim=1) - 1).pow(2).mean()
    with pytest.raises(RuntimeError, match="does not currently support double backward") as info:
        penalty.backward()
    assert "donated" not in str(info.value)
