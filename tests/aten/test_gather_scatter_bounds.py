"""gather/scatter with one index per row (aten/lowerings/gather_scatter.py): index bounds.

ember lowers them as one-hot selections, which never read out of bounds but would silently select
nothing (0) for an index outside [0, n). Eager raises instead (CPU: RuntimeError "index 5 is out of
bounds for dimension 1 with size 5"; negative indices too), so ember checks the index and raises
through an `_assert_async` extern. The losses that pick targets this way (nll_loss, cross_entropy)
mask their ignore_index before the gather, so an ignored target must not trip the check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import BACKENDS, assert_close, ember_compile, explain_strict, repro

ROWS, COLS = 4, 5

PROGRAMS = {
    "gather": lambda x, i: x.gather(1, i) * 2,
    "gather_dim0": lambda x, i: x.t().gather(0, i.t()),
    # The pick is pushed through the log-softmax down to the load of x (gather(x - lse)).
    "gather_log_softmax": lambda x, i: x.log_softmax(-1).gather(-1, i),
    "scatter_value": lambda x, i: x.scatter(1, i, 3.0),
    "scatter_src": lambda x, i: x.scatter(1, i, torch.full_like(i, 7, dtype=x.dtype)) + 1,
}

BAD = {"too_large": COLS, "negative": -1}


def _index(bad: int | None = None) -> torch.Tensor:
    index = torch.tensor([[0], [COLS - 1], [2], [1]])
    if bad is not None:
        index[1, 0] = bad
    return index


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_in_range_matches_eager(backend, name):
    fn, x, index = PROGRAMS[name], torch.randn(ROWS, COLS), _index()
    line = repro(backend=backend, program=name)
    assert_close(ember_compile(fn, backend)(x, index), fn(x, index), rtol=1e-5, atol=1e-6, what=name, line=line)
    # Lowered (not an ATen gather/scatter), with its bounds check beside it.
    (graph,) = explain_strict(fn, x, index, backend=backend).graphs
    assert graph.externs == ["_assert_async"], f"{graph}\n{line}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_out_of_range_raises_as_eager_does(backend, name, bad):
    fn, x, index = PROGRAMS[name], torch.randn(ROWS, COLS), _index(BAD[bad])
    with pytest.raises(RuntimeError, match="out of bounds for dimension"):
        fn(x, index)  # eager: "index 5 is out of bounds for dimension 1 with size 5"
    compiled = ember_compile(fn, backend)
    compiled(x, _index())  # compiled once, in range
    with pytest.raises(RuntimeError, match=f"{name.split('_')[0]}\\(\\): index out of bounds for dimension"):
        compiled(x, index)


def test_symbolic_size_out_of_range_raises():
    fn = PROGRAMS["gather"]
    compiled = ember_compile(fn, "cpp", dynamic=True)
    for cols in (5, 7):
        x = torch.randn(ROWS, cols)
        index = torch.tensor([[0], [cols - 1], [2], [1]])
        torch.testing.assert_close(compiled(x, index), fn(x, index))
        index[2, 0] = cols
        with pytest.raises(RuntimeError, match="gather\\(\\): index out of bounds for dimension 1"):
            compiled(x, index)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, -1, 2])
def test_cross_entropy_ignore_index(backend, reduction, ignore_index):
    """Ignored targets (default -100, or any other value, in range or not) are masked to 0 before
    the gather: they neither trip the bounds check nor count; forward and gradient match eager."""
    x = torch.randn(6, 9)
    t = torch.tensor([3, ignore_index, 8, 0, ignore_index, 5])
    fn = lambda x, t: F.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction)
    line = repro(backend=backend, reduction=reduction, ignore_index=ignore_index)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = fn(xe, t), ember_compile(fn, backend)(xc, t)
    assert_close(got, want, rtol=1e-5, atol=1e-6, what="loss", line=line)
    cot = torch.randn_like(want)
    (want_grad,), (got_grad,) = torch.autograd.grad(want, xe, cot), torch.autograd.grad(got, xc, cot)
    assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6, what="grad", line=line)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target", [9, -5])
def test_nll_loss_target_out_of_range_raises(backend, target):
    """A target outside [0, C) that is not ignore_index raises, as eager does. Eager's nll_loss kernel
    raises IndexError("Target 9 is out of bounds."); ember's (nll_loss decomposed into a gather)
    raises the gather's RuntimeError."""
    x, t = torch.randn(6, 9).log_softmax(-1), torch.tensor([3, -100, 8, 0, target, 5])
    with pytest.raises(IndexError, match="out of bounds"):
        F.nll_loss(x, t)
    compiled = ember_compile(F.nll_loss, backend)
    valid = torch.where(t == target, 4, t)
    torch.testing.assert_close(compiled(x, valid), F.nll_loss(x, valid))
    with pytest.raises(RuntimeError, match="gather\\(\\): index out of bounds"):
        compiled(x, t)
