"""Per pattern: how many kernels the scheduler makes and how many bytes they move.

Each case is a real PyTorch program compiled through ember (C++ backend, inference), checked
against eager, and its schedule compared with the bytes a perfect fusion must move: every
input read once, every output written once (broadcast inputs counted at their own size).
The expected numbers are written out from the shapes, not read back from ember.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember import config
from ember.target import SplitHeuristics
from tests.helpers import assert_close, ember_compile, reports, repro, tensors

F32 = 4
N, C = 64, 256  # rows x features of the row-wise patterns


def _layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def _rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _ln_residual_gelu(x, r, w, b):
    h = x + r
    return F.gelu(F.layer_norm(h, (C,), w, b), approximate="tanh"), h


def _attention_softmax(q, k, v):
    scores = q @ k.transpose(-2, -1) / 8.0
    return scores.softmax(-1) @ v


def _qkv_slices(qkv):
    q, k, v = qkv.split(C, dim=-1)
    return q * 0.125, k.float() + 1.0, torch.relu(v)


def _x(*shape):
    return torch.randn(*shape)


# name, function, inputs, kernels, expected bytes (None: checked by the case's own assertion)
CASES = [
    ("pointwise_chain", lambda x: torch.relu(x * 2 + 1).sigmoid(), lambda: [_x(N, C)], 1, 2 * N * C * F32),
    ("broadcast_adds", lambda x, b, c: x + b + c, lambda: [_x(N, C), _x(C), _x(N, 1)], 1, (2 * N * C + C + N) * F32),
    ("softmax", lambda x: x.softmax(-1), lambda: [_x(N, 1000)], 1, 2 * N * 1000 * F32),
    ("layer_norm", _layer_norm, lambda: [_x(N, C), _x(C), _x(C)], 1, (2 * N * C + 2 * C) * F32),
    ("rmsnorm", _rmsnorm, lambda: [_x(N, C), _x(C)], 1, (2 * N * C + C) * F32),
    ("ln_residual_gelu", _ln_residual_gelu, lambda: [_x(N, C), _x(N, C), _x(C), _x(C)], 1, (4 * N * C + 2 * C) * F32),
    # The reduction reads x down its columns: one kernel, x read once.
    ("transpose_reduction", lambda x: x.t().sum(-1), lambda: [_x(C, N)], 1, (C * N + N) * F32),
    # Between the two matmul externs: one softmax kernel that reads the scores and writes the
    # probabilities once (the attention pattern rewrite is off to look at the softmax itself).
    (
        "attention_softmax",
        _attention_softmax,
        lambda: [_x(2, 4, 32, 16) for _ in range(3)],
        1,
        2 * 2 * 4 * 32 * 32 * F32,
    ),
    # One kernel reads the projection once and writes the three results.
    ("qkv_slices", _qkv_slices, lambda: [_x(N, 3 * C)], 1, 6 * N * C * F32),
]


@pytest.mark.parametrize("name,fn,make,kernels,expected", CASES, ids=[c[0] for c in CASES])
def test_kernels_and_bytes(name, fn, make, kernels, expected):
    inputs = make()
    line = repro(pattern=name, inputs=inputs)
    with reports() as report, config.override(patterns=False):
        out = ember_compile(fn, "cpp")(*inputs)
    for got, want in zip(tensors(out), tensors(fn(*inputs))):
        assert_close(got, want, rtol=1e-5, atol=1e-5, what=name, line=line)
    (graph,) = report.graphs
    assert len(graph.kernels) == kernels, f"{name}: {len(graph.kernels)} kernels, want {kernels}\n{graph}\n{line}"
    assert graph.bytes == expected, f"{name}: {graph.bytes} bytes, want {expected}\n{graph}\n{line}"
    assert graph.peak_bytes <= graph.eager_peak_bytes, f"{name}: planned peak above eager's\n{graph}\n{line}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_never_writes_the_log_softmax(dtype):
    """The target's log-probability is picked inside the kernel that computes the row's
    log-sum-exp: logits are read once, nothing of their size is written."""
    x, t = torch.randn(N, 1000, dtype=dtype), torch.randint(0, 1000, (N,))
    t[3] = -100  # ignore_index
    line = repro(dtype=dtype)
    with reports() as report:
        got = ember_compile(F.cross_entropy, "cpp")(x, t)
    want = F.cross_entropy(x.float(), t)
    assert_close(got.float(), want, rtol=0, atol=0.02 if dtype == torch.bfloat16 else 1e-5, what="loss", line=line)
    (graph,) = report.graphs
    # The only extern is the targets' bounds check, whose all-reduction joins the mean's kernel.
    assert graph.externs == ["_assert_async"], f"{graph}\n{line}"
    assert len(graph.kernels) == 2, f"{graph}\n{line}"  # per-row loss, then the mean over rows
    # x once; the targets twice (to pick, then to count the rows for the mean and check their
    # bounds); per row, the max, the sum of exponentials and the picked logit written and read
    # back (the loss of a row is computed from them in the mean's kernel); the loss itself; the
    # bounds check's flag.
    floor = x.nbytes + 2 * t.nbytes + 3 * 2 * N * F32 + F32 + 1
    assert x.nbytes <= graph.bytes <= floor, f"{graph.bytes} bytes, want <= {floor}\n{graph}\n{line}"


def test_split_reduction_stages_of_one_kernel_share_launches():
    """On Triton the mean over the rows (as many as the split's min_reduce) is split in two stages,
    and so is the targets' bounds check; each first stage (one reads the per-row losses, one the
    targets) and each second stage is a sibling of the other through the kernel both feed or both
    read: 3 kernels, not 5."""
    rows = SplitHeuristics().min_reduce
    x, t = torch.randn(rows, 8), torch.randint(0, 8, (rows,))
    line = repro(backend="triton", shape=list(x.shape))
    with reports() as report:
        got = ember_compile(F.cross_entropy, "triton")(x, t)
    assert_close(got, F.cross_entropy(x, t), rtol=1e-5, atol=1e-6, what="loss", line=line)
    (graph,) = report.graphs
    assert graph.externs == ["_assert_async"], f"{graph}\n{line}"
    assert len(graph.kernels) == 3, f"{graph}\n{line}"  # per-row losses; first stages; second stages


def test_cross_entropy_training_matches_eager():
    x = torch.randn(N, 1000, requires_grad=True)
    t = torch.randint(0, 1000, (N,))
    line = repro(shape=list(x.shape))
    with reports() as report:
        loss = ember_compile(F.cross_entropy, "cpp")(x, t)
        (grad,) = torch.autograd.grad(loss, x)
    want = F.cross_entropy(x, t)
    (want_grad,) = torch.autograd.grad(want, x)
    assert_close(loss, want, rtol=1e-5, atol=1e-6, what="loss", line=line)
    assert_close(grad, want_grad, rtol=1e-5, atol=1e-7, what="grad", line=line)
    backward = next(g for g in report.graphs if g.kind == "backward")
    # The one-hot of the target is a select inside the gradient kernel, not a scattered buffer.
    assert all("scatter" not in e for e in backward.externs), f"{backward}\n{line}"
