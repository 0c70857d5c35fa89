"""Values computed from constants alone, folded when a graph is compiled (frontend/constant_fold.py):
the results against eager, what the host program still computes, and what is never folded (a value
handed to the caller, randomness, a value over the size bound)."""

from __future__ import annotations

import torch

from ember.frontend.constant_fold import MAX_FOLDED_BYTES
from tests.helpers import assert_close, assert_no_fallback, ember_compile, reports, repro


def _folded(report) -> list[str]:
    return [e for g in report.graphs for e in g.externs if e.startswith("constant _ember_folded")]


def _index_table(n: int) -> torch.Tensor:
    """An index table built as FlexAttention builds a BlockMask's transposed lists: factories, a scatter, a sort."""
    order = torch.zeros(n, dtype=torch.int64).index_put((torch.arange(n),), torch.arange(n) % 3)
    return torch.sort(order, stable=True, descending=True).indices


def test_a_table_built_from_constants_is_computed_once_and_matches_eager():
    def f(x):
        return x[_index_table(x.shape[0])] * 2 + torch.arange(x.shape[0])[:, None]

    x = torch.randn(6, 4)
    line = repro(program="x[sort(index_put(zeros, arange, arange % 3))] * 2 + arange", x="f32[6, 4]")
    with reports() as report:
        got = ember_compile(f, "cpp")(x)
    assert_no_fallback(report, line)
    assert_close(got, f(x), rtol=0, atol=0, what="output", line=line)
    externs = [e for g in report.graphs for e in g.externs]
    assert _folded(report) and not {"sort", "index_put"} & set(externs), (externs, line)


def test_a_constant_handed_to_the_caller_stays_computed_at_every_call():
    """The caller may write an output in place: were it the graph's constant, the next call would read the write."""

    def f(x):
        table = torch.arange(4.0) * 2
        return x + table, table

    compiled = ember_compile(f, "cpp")
    line = repro(program="(x + arange(4) * 2, arange(4) * 2)", x="f32[4]")
    x = torch.ones(4)
    _, table = compiled(x)
    table.add_(100)  # the caller's own tensor
    again, table_again = compiled(x)
    assert_close(again, f(x)[0], rtol=0, atol=0, what="output after the caller wrote its table", line=line)
    assert_close(table_again, f(x)[1], rtol=0, atol=0, what="table after the caller wrote the last one", line=line)
    assert table_again.data_ptr() != table.data_ptr(), line


def test_randomness_and_values_over_the_bound_stay_computed():
    big = MAX_FOLDED_BYTES // 4 + 1  # float32 elements: one over the bound

    def f(x):
        return x + torch.rand(4), x.sum() + torch.ones(big).cumsum(0)[-1]

    compiled = ember_compile(f, "cpp")
    line = repro(program="(x + rand(4), x.sum() + ones(n).cumsum(0)[-1])", n=big)
    x = torch.zeros(4)
    with reports() as report:
        (a, total), (b, _) = compiled(x), compiled(x)
    assert not torch.equal(a, b), f"a random value was computed once\n{line}"
    assert total.item() == float(big) and not _folded(report), (_folded(report), line)


def test_a_training_forward_folds_the_constants_only_its_backward_reads():
    """In a training graph the forward's constants are folded too (FlexAttention's BlockMask lists, which its
    backward reads), and the loss and gradients stay eager's."""

    def f(x, w):
        table = _index_table(x.shape[0])
        return (x[table] * w).sum(1)

    x, w = torch.randn(6, 4), torch.randn(4, requires_grad=True)
    line = repro(program="(x[sort(...)] * w).sum(1), gradient of w", x="f32[6, 4]")
    with reports() as report:
        out = ember_compile(f, "cpp")(x, w)
        (grad,) = torch.autograd.grad(out.sum(), w)
    expected = f(x, w)
    assert_close(out, expected, rtol=1e-6, atol=1e-6, what="output", line=line)
    assert_close(grad, torch.autograd.grad(expected.sum(), w)[0], rtol=1e-6, atol=1e-6, what="w's gradient", line=line)
    assert _folded(report), line


def _sorted_mask() -> torch.Tensor:
    return _index_table(4).to(torch.float32)


def test_outputs_reached_through_unannotated_views_stay_computed():
    """`_unsafe_view` (a reshape of a non-contiguous tensor, a 3-D product) and `unsafe_split` return views with
    no alias annotation: the caller's write to such an output must not reach the next call."""
    w = torch.randn(4, 5)
    programs = {
        "reshape of a non-contiguous constant": lambda x: (
            x + 1,
            torch.cat([_sorted_mask()] * 2).reshape(2, 4).t().reshape(-1),
        ),
        "3-D product of constants": lambda x: (x + 1, _sorted_mask().expand(2, 3, 4) @ w),
        "unsafe_split": lambda x: (x + 1, torch.ops.aten.unsafe_split.Tensor(_sorted_mask(), 2)[0]),
    }
    for name, f in programs.items():
        compiled = ember_compile(f, "cpp")
        line = repro(program=name)
        x = torch.ones(4)
        _, kept = compiled(x)
        kept.add_(1000)
        _, again = compiled(x)
        assert_close(
            again, f(x)[1], rtol=1e-6, atol=1e-6, what=f"{name} after the caller wrote the last one", line=line
        )


class _StraightThrough(torch.autograd.Function):
    """A gradient that is a tensor saved by the forward: here a table built from constants alone."""

    @staticmethod
    def forward(ctx, x):
        mask = _sorted_mask()
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return mask


def test_a_gradient_that_is_a_saved_constant_is_the_caller_s_own():
    compiled = ember_compile(_StraightThrough.apply, "cpp")
    line = repro(program="autograd.Function whose backward returns its saved sort-built table")
    x = torch.randn(4, requires_grad=True)
    (first,) = torch.autograd.grad(compiled(x).sum(), x)
    first.add_(1000)
    (again,) = torch.autograd.grad(compiled(x).sum(), x)
    assert_close(again, _sorted_mask(), rtol=0, atol=0, what="gradient after the caller wrote the last one", line=line)


def test_a_custom_op_is_never_run_at_compile_time():
    calls = []

    @torch.library.custom_op("ember_test::counted", mutates_args=())
    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x + len(calls)

    @counted.register_fake
    def _(x):
        return torch.empty_like(x)

    def f(x):
        return x + counted(torch.zeros(2))

    compiled = ember_compile(f, "cpp")
    x = torch.zeros(2)
    before = len(calls)
    got = [compiled(x) for _ in range(2)]
    assert len(calls) == before + 2 and not torch.equal(got[0], got[1]), repro(program="x + counter op(zeros)")
