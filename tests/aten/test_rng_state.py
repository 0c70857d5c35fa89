"""Activation checkpointing's RNG ops compiled as extern steps (aten/lowerings/rng_state.py): a
checkpointed region with a random op (SDPA, dropout) compiles without falling back, its gradients
are eager's, and the backward's recomputation draws what the forward drew."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ember
from ember.runtime.cudagraphs import extern_refusal
from tests.helpers import assert_no_fallback, reports


def _compiled_grads(fn, *tensors, backend="cpp"):
    leaves = [t.detach().requires_grad_(True) for t in tensors]
    torch._dynamo.reset()
    with reports() as report, ember.config.override(strict=True, backend=backend):
        out = torch.compile(fn, backend="ember")(*leaves)
        grads = torch.autograd.grad(out.sum(), leaves)
    assert_no_fallback(report, fn.__name__)
    externs = " ".join(str(e) for g in report.graphs for e in g.externs)
    assert "run_and_save_rng_state" in externs and "run_with_rng_state" in externs, externs
    return out, grads


def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def checkpointed_attention(q, k, v):
    return checkpoint(_attend, q, k, v, use_reentrant=False) * 2


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_checkpointed_attention_compiles_and_trains_as_eager(backend):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    out, grads = _compiled_grads(checkpointed_attention, q, k, v, backend=backend)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    expected = checkpointed_attention(*leaves)
    torch.testing.assert_close(out, expected)
    for g, e in zip(grads, torch.autograd.grad(expected.sum(), leaves)):
        torch.testing.assert_close(g, e)


def checkpointed_dropout(x):
    return checkpoint(lambda a: F.dropout(a, 0.5, training=True) * 3, x, use_reentrant=False)


def test_the_recomputed_dropout_draws_the_forwards_mask():
    """y = dropout(x) * 3 = x * mask * 6: the gradient of sum(y) is mask * 6, from the backward's
    recomputation, and y / x gives the forward's mask: they agree only if both drew the same."""
    torch.manual_seed(0)
    x = torch.rand(64, 64) + 0.5  # no zeros
    out, (grad,) = _compiled_grads(checkpointed_dropout, x)
    kept = out != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(grad, kept.float() * 6)
    torch.testing.assert_close(out[kept], x[kept] * 6)


def checkpointed_noise(x):
    return checkpoint(lambda a: a * torch.rand_like(a), x, use_reentrant=False)


def test_a_recomputed_random_op_with_one_result_draws_the_forwards_numbers():
    """rand_like returns one tensor (no getitem tells its value): y = x * r, so the gradient of sum(y)
    is r as the backward redraws it, and y / x is r as the forward drew it."""
    torch.manual_seed(0)
    x = torch.rand(32, 32) + 0.5
    out, (grad,) = _compiled_grads(checkpointed_noise, x)
    torch.testing.assert_close(grad, out / x)
    assert 0.3 < grad.mean() < 0.7


def test_cuda_graphs_refuse_the_host_side_generator_state():
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    for op in (run_and_save_rng_state, run_with_rng_state):
        reason = extern_refusal(op, (), {})
        assert reason is not None and "generator" in reason
