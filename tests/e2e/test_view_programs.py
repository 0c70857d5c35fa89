"""Movement ops are index math: programs built from views, compiled by ember, against eager.

Each row names a program, its input shapes and how many kernels it may take. A view by
itself never costs a kernel: a program of one pointwise/reduction step over views of its
inputs is one kernel, with no copy kernel in front of it.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import BACKENDS, assert_close, assert_no_fallback, ember_compile, reports, repro

# name: (fn, input shapes, kernels)
PROGRAMS = {
    "t_add_sum0": (lambda x: (x.t() + 1).sum(0), [(16, 24)], 1),
    "permute_mul": (lambda x: x.permute(2, 0, 1) * 2, [(4, 5, 6)], 1),
    "slice_step": (lambda x: x[:, 1::2] + 1, [(8, 10)], 1),
    "slice_rows": (lambda x, y: x[2:7] * y[:5], [(9, 6), (7, 6)], 1),
    "select": (lambda x: x.select(1, 3) * 2, [(5, 6, 7)], 1),
    "select_negative": (lambda x: x[:, -1] + x[:, 0], [(5, 6)], 1),
    "unsqueeze_outer_sum": (lambda x, y: x.unsqueeze(1) + y.unsqueeze(0), [(6,), (7,)], 1),
    "expand_mul": (lambda x, z: x.unsqueeze(-1).expand(-1, -1, z.shape[-1]) * z, [(3, 5), (3, 5, 4)], 1),
    "bias_broadcast": (lambda x, b: x + b, [(8, 16), (16,)], 1),
    "squeeze": (lambda x: x.squeeze(1) + 1, [(4, 1, 6)], 1),
    "reshape_input_sum": (lambda x: x.reshape(4, 6, 8).sum(1), [(24, 8)], 1),
    "reshape_computed_sum": (lambda x: (x * 2).reshape(4, 6, 8).sum(1), [(24, 8)], 1),
    "flatten_output": (lambda x: (x + 1).view(-1), [(4, 6)], 1),
    "transpose_then_reshape": (lambda x: x.t().reshape(-1) * 2, [(4, 6)], 1),
    "split_heads": (lambda x: x.view(2, 3, 4, 5).transpose(1, 2).reshape(2, 4, 15) + 1, [(2, 3, 20)], 1),
    "permute_slice_chain": (lambda x: (x.permute(1, 0, 2)[1:, :, ::2] * 3).sum(-1), [(4, 5, 6)], 1),
    "transposed_output": (lambda x: (x * 2).t(), [(4, 6)], 1),
    "softmax_of_transpose": (lambda x: torch.softmax(x.t(), -1), [(8, 12)], 1),
    "mean_over_permuted": (lambda x: x.permute(2, 1, 0).mean(-1), [(4, 5, 6)], 1),
    # A materializing copy is one kernel, not two.
    "contiguous_copy": (lambda x: x.t().contiguous(), [(4, 6)], 1),
    # cat and constant padding are selections among clamped views: fused, no copy kernel.
    "rotate_half": (lambda x, c, s: x * c + _rotate_half(x) * s, [(2, 3, 8), (8,), (8,)], 1),
    "cat_computed_pieces": (lambda a, b: torch.cat([a * 2, b.exp(), a], 0) + 1, [(3, 5), (2, 5)], 1),
    "cat_then_sum": (lambda a, b: torch.cat([a, b.t()], 1).sum(1), [(4, 3), (2, 4)], 1),
    "cat_transposed_output": (lambda a, b: torch.cat([a, b], 1).t() * 1, [(3, 4), (3, 2)], 1),
    "pad_constant": (lambda x: torch.nn.functional.pad(x, (1, 2, 0, 3), value=-1.5) * 2, [(2, 4, 5)], 1),
    "pad_and_crop": (lambda x: torch.nn.functional.pad(x, (-1, 2, 2, -1)) + 1, [(4, 5)], 1),
}


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# Inputs of a second size for the dynamic-shape runs.
def _grow(shape):
    return tuple(s + 2 if s > 1 else s for s in shape)


def _cases():
    for backend in BACKENDS:
        for dynamic in (False, True):
            for name in PROGRAMS:
                yield pytest.param(backend, dynamic, name, id=f"{backend}-{'dynamic' if dynamic else 'static'}-{name}")


# Size-dependent programs whose second size would change their meaning.
_STATIC_ONLY_SIZES = {"reshape_input_sum", "reshape_computed_sum", "split_heads", "select", "slice_rows"}


@pytest.mark.parametrize("backend,dynamic,name", list(_cases()))
def test_view_program(backend, dynamic, name):
    fn, shapes, kernels = PROGRAMS[name]
    compiled = ember_compile(fn, backend, dynamic=dynamic)
    size_sets = [shapes]
    if dynamic and name not in _STATIC_ONLY_SIZES:
        size_sets.append([_grow(s) for s in shapes])
    with reports() as report:
        for sizes in size_sets:
            inputs = [torch.randn(s) for s in sizes]
            line = repro(program=name, backend=backend, dynamic=dynamic, dtype=torch.float32, inputs=inputs)
            assert_close(compiled(*inputs), fn(*inputs), rtol=1e-5, atol=1e-6, what=name, line=line)
    assert_no_fallback(report, line)
    assert len(report.graphs) == 1, f"{len(report.graphs)} graphs compiled (a recompile for the second size?)\n{line}"
    for g in report.graphs:
        assert len(g.kernels) == kernels, f"expected {kernels} kernel(s), got:\n{g}\n{line}"
        assert not g.externs, f"views ran as externs:\n{g}\n{line}"
