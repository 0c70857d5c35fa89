"""Memory planning (in place, reuse, planned peak) and the reasons fusion gives for refusing,
on small real programs compiled through ember and checked against eager."""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch

from ember import config
from tests.helpers import assert_close, ember_compile, randomize_bn, reports, repro, tensors

# These programs' products are ATen's externs, whose memory the plan reasons about (ember's C++ GEMM
# template off; tests/codegen/test_gemm_cpp.py runs such programs through the template).
BLAS = "cpp.gemm_template=0"


def _run(fn, *inputs, **options):
    options.setdefault("heuristics", BLAS)
    torch._dynamo.reset()  # a fresh capture: the same function may run under other settings
    line = repro(fn=fn.__name__, inputs=list(inputs))
    with reports() as report, config.override(**options):
        out = ember_compile(fn, "cpp")(*inputs)
    for got, want in zip(tensors(out), tensors(fn(*inputs))):
        assert_close(got, want, rtol=1e-5, atol=1e-5, what=fn.__name__, line=line)
    (graph,) = report.graphs
    return graph, line


def test_pointwise_writes_in_place_of_a_dead_intermediate():
    def mlp_step(x, w):
        u = x * 2
        v = u + u @ w  # reads u element by element, u's last use: v takes u's memory
        return v @ w

    graph, line = _run(mlp_step, torch.randn(32, 64), torch.randn(64, 64))
    assert "1 in place" in graph.memory, f"{graph}\n{line}"
    assert "# in place" in graph.host_source, f"{graph.host_source}\n{line}"
    assert graph.peak_bytes <= graph.eager_peak_bytes, f"{graph}\n{line}"


def test_two_outputs_of_one_kernel_never_share_a_dead_buffer():
    # Found by the OpInfo sweep (scatter_reduce.prod / index_reduce gradients, silently wrong): both
    # values the kernel stores read t element by element at its last use, and both were written in
    # place of t, one over the other.
    def two_reads_of_a_dying_buffer(x, w):
        t = torch.sin(x)
        u = t @ w  # t is stored for the product; the kernel below cannot fuse with sin (a cycle)
        a, b = t * u, t + u  # one kernel, two stores read by the products below
        return a @ w, b @ w

    graph, line = _run(two_reads_of_a_dying_buffer, torch.randn(8, 8), torch.randn(8, 8))
    donors = [ln.split("=")[1].split("#")[0].strip() for ln in graph.host_source.splitlines() if "# in place" in ln]
    assert len(donors) == len(set(donors)), f"{graph.host_source}\n{line}"  # each in a buffer of its own


def test_dead_buffer_reused_by_a_smaller_one():
    def shrink(x, w1, w2):
        a = torch.relu(x @ w1)  # [32, 128]
        b = torch.relu(a @ w2) * 2  # [32, 64] fits in a's memory, freed by then
        return (b @ w2.t()).sum()

    graph, line = _run(shrink, torch.randn(32, 64), torch.randn(64, 128), torch.randn(128, 64))
    reused = int(graph.memory.split(";")[1].split("buffers reused")[0])
    assert reused + graph.memory.count("1 in place") >= 1, f"{graph}\n{line}"
    assert graph.peak_bytes <= graph.eager_peak_bytes, f"{graph}\n{line}"


def test_an_output_takes_no_bigger_allocation():
    """A graph output keeps its whole allocation alive in the caller's hands: a small output placed
    in a dead buffer that had itself been handed a bigger one pinned the bigger one (a batch-norm
    weight's gradient held a 1 MB activation buffer in a ResNet backward)."""

    def shrink_then_return(x, w1, w2, w3):
        a = torch.relu(x @ w1)  # [32, 128]
        s = torch.relu(a @ w2) * 2  # [32, 64]: takes a's memory, a is dead
        r = s @ w3  # s dies here: the free list holds s, in a's [32, 128] allocation
        return torch.relu(r) + 1  # [32, 64], s's exact layout

    inputs = (torch.randn(32, 64), torch.randn(64, 128), torch.randn(128, 64), torch.randn(64, 64))
    graph, line = _run(shrink_then_return, *inputs)
    torch._dynamo.reset()
    out = ember_compile(shrink_then_return, "cpp", heuristics=BLAS)(*inputs)
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size(), f"{graph.host_source}\n{line}"


def test_an_epilogue_writes_over_a_product_of_another_shape():
    """Linear over [4, 512, 768] is addmm on [2048, 768]: the GELU's [4, 512, 3072] output has the
    product's bytes, and takes them even when it is kept in its own shape (a graph output here; a
    value the next Linear views as [2048, 3072] in BERT, whose every layer took a second 100 MB)."""
    lin = torch.nn.Linear(64, 96)

    def linear_gelu(x):
        return torch.nn.functional.gelu(lin(x))

    x = torch.randn(4, 32, 64)
    with torch.no_grad():
        graph, line = _run(linear_gelu, x)
        want = linear_gelu(x)
        torch._dynamo.reset()
        out = ember_compile(linear_gelu, "cpp", heuristics=BLAS)(x)
    assert re.search(r"\b1 in place", graph.memory), f"{graph.memory}\n{graph.host_source}\n{line}"
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size(), line
    assert_close(out, want, rtol=1e-5, atol=1e-5, what="linear + gelu", line=line)


def _refusals(graph) -> str:
    return "\n".join(f.reason for f in graph.rejected)


def test_refuses_a_merge_that_would_form_a_cycle():
    def diamond(x, w):
        a = torch.relu(x)
        return a * 3 + a @ w  # merging relu into the add would need the matmul inside the kernel

    graph, line = _run(diamond, torch.randn(16, 32), torch.randn(32, 32))
    assert len(graph.kernels) == 2 and "would form a cycle" in _refusals(graph), f"{graph}\n{line}"


def test_refuses_a_reduction_read_off_its_row():
    def column_broadcast(x):
        return x + x.sum(-1)  # row sums broadcast along the other axis: indexed by column

    graph, line = _run(column_broadcast, torch.randn(16, 16))
    assert "not at its row" in _refusals(graph), f"{graph}\n{line}"


def test_refuses_too_many_buffers():
    def two_outputs(x, y):
        return (x + y).sum(-1), x * y

    graph, line = _run(two_outputs, torch.randn(8, 32), torch.randn(8, 32), max_kernel_buffers=3)
    assert len(graph.kernels) == 2 and "too many buffers" in _refusals(graph), f"{graph}\n{line}"
    graph, line = _run(two_outputs, torch.randn(8, 32), torch.randn(8, 32))
    assert len(graph.kernels) == 1, f"{graph}\n{line}"


def test_fusion_log_lists_kernels_and_refusals():
    def diamond(x, w):
        a = torch.relu(x)
        return a * 3 + a @ w

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("ember").addHandler(handler)
    try:
        _run(diamond, torch.randn(16, 32), torch.randn(32, 32), logs="fusion")
    finally:
        logging.getLogger("ember").removeHandler(handler)
    err = stream.getvalue()
    assert "=== fusion: inference ===" in err and "planned peak" in err
    assert "MFLOP" in err and "would form a cycle" in err, err


def test_zero_dim_values_shared_by_two_outputs():
    """A 0-d domain's index is () (falsy but valid); found by the OpInfo sweep (atan2 backward)."""

    def shared(a, b):
        h = a * a + b
        return h * b, h * a

    graph, line = _run(shared, torch.randn(()), torch.randn(()))
    assert not graph.fallback, line


def test_bf16_value_cast_to_f32_is_rounded_first():
    """Found by ember fuzz (seed 2026, program 283): a bf16 value cast to f32 in the kernel that
    also stores it must see the rounded bf16 value, as eager does."""

    def norm_then_widen(x):
        return torch.nn.functional.layer_norm(3 / x, (1,)).float().sum(0, keepdim=True)

    # Training: the bf16 value is stored for the backward by the kernel that also widens it.
    x = torch.tensor([[0.7], [-1.3]], dtype=torch.bfloat16, requires_grad=True)
    line = repro(x=x)
    torch._dynamo.reset()
    got = ember_compile(norm_then_widen, "cpp")(x)
    assert_close(got, norm_then_widen(x), rtol=0, atol=1e-3, what="layer_norm then float", line=line)


def test_no_dead_buffer_is_held_idle_across_the_peak():
    """Under autocast, small values (weights cast to bf16) took a dead activation buffer freed before
    the peak, holding it across the peak (transformers' ResNet-50 at batch 64: 328 MB planned, 231 MB
    with the rule, Inductor's measured peak). A dead buffer is now taken only where what it holds idle
    or unused keeps every step within the peak of a placement that frees every dead buffer (as the
    allocator would): the plan's peak is that placement's, below the greedy one's."""
    from torch import nn

    from ember import pipeline
    from ember.schedule import memory

    def conv_bn(cin: int, cout: int, k: int = 1, stride: int = 1) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout))

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, mid: int, stride: int):
            super().__init__()
            self.body = nn.Sequential(
                conv_bn(cin, mid), nn.ReLU(), conv_bn(mid, mid, 3, stride), nn.ReLU(), conv_bn(mid, 4 * mid)
            )
            self.down = conv_bn(cin, 4 * mid, 1, stride) if stride != 1 or cin != 4 * mid else nn.Identity()

        def forward(self, x):
            return torch.relu(self.body(x) + self.down(x))

    blocks = [Bottleneck(16, 16, 1), Bottleneck(64, 16, 1), Bottleneck(64, 32, 2), Bottleneck(128, 32, 1)]
    net = randomize_bn(nn.Sequential(conv_bn(3, 16, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1), *blocks)).eval()
    x = torch.randn(2, 3, 64, 64)
    scheduled = []
    finish = pipeline._finish

    def recording(sched, *args):
        scheduled.append(sched)
        return finish(sched, *args)

    torch._dynamo.reset()
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=torch.bfloat16),
        reports() as report,
        config.override(cache=False, channels_last=False),
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(pipeline, "_finish", recording)
        out = ember_compile(net, "cpp")(x)
        expected = net(x)
    line = repro(model="4 bottlenecks under bf16 autocast")
    assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2, what="output", line=line)
    (graph,) = report.graphs
    (sched,) = scheduled
    uses = memory._uses(sched.graph, sched.steps)
    freeing = memory._place(uses, sched.steps, reuse=False).peak
    greedy = memory._place(uses, sched.steps, reuse=True).peak
    assert greedy > freeing, f"the case no longer holds a dead buffer across its peak\n{graph}\n{line}"
    assert graph.peak_bytes == freeing, f"{graph.memory}: {freeing} bytes freeing every dead buffer\n{line}"
