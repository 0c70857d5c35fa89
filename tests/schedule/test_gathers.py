"""Gathers computed by the kernels that read them, and scatter-adds added atomically by the kernels computing
the added values (schedule/gathers.py, schedule/indexed_store.py): checked against eager through Triton's
interpreter and the C++ backend, with each graph's report (the op among a kernel's, no ATen call), and the
cases that must stay ATen calls.
"""

from __future__ import annotations

import pytest
import torch

from ember.report import collecting
from tests.helpers import assert_close, ember_compile, repro, tensors

TOL = {"rtol": 1e-5, "atol": 1e-5}


def messages(x, w, src, weight):
    """A graph convolution's messages: each edge's source row of x @ w, scaled by the edge's weight."""
    return (x @ w).index_select(0, src) * weight.view(-1, 1)


def embed(table, ids, positions):
    return torch.nn.functional.embedding(ids, table) * 2 + positions


def columns(x, idx):
    return (x[:, idx] + 1).relu()  # indexing wraps -1 to the last column


def gather_per_element(x, idx):
    return x.exp().gather(1, idx) * 3  # the source computed where the kernel reads it


def gathered_row_sums(x, idx):
    return x[idx].sum(-1)


def graph_convolution(x, w, b, edges, weight):
    """torch_geometric's GCN layer as it reaches ATen: gather, scale, scatter-add, bias; and the degrees."""
    h = x @ w
    src, dst = edges[0], edges[1]
    msg = h.index_select(0, src) * weight.view(-1, 1)
    out = torch.zeros_like(h).scatter_add_(0, dst.view(-1, 1).expand_as(msg), msg)
    degree = torch.zeros(x.shape[0]).scatter_add_(0, dst, torch.ones_like(weight))
    return out + b, degree


def combine_experts(x, idx, weights):
    return torch.zeros(6, 4).index_add_(0, idx, x * weights[:, None])


def accumulate_rows(ids, g):
    out = torch.zeros(10, 4)
    out.index_put_((ids,), g * 2, accumulate=True)  # -1 is the last row
    return out


def add_into_computed(x, idx, src):
    return (x * 2).scatter_add(0, idx, src.sigmoid())  # the initial value is not zeros: copied first


def _run(fn, args, backend="triton", **options):
    torch._dynamo.reset()
    with collecting() as report:
        got = ember_compile(fn, backend, **options)(*args)
    want = fn(*args)
    line = repro(backend=backend, device="cpu", fn=fn.__name__)
    for g, w in zip(tensors(got), tensors(want)) if want is not None else ():
        assert_close(g, w, **TOL, what="result", line=line)
    return report.graphs, line


def _kernels_and_calls(graphs, op):
    kernels = [k for g in graphs for k in g.kernels if any(op in o for o in k.ops)]
    return kernels, [e for g in graphs for e in g.externs if op in e]


GATHERS = [
    (messages, (torch.randn(8, 4), torch.randn(4, 4), torch.randint(0, 8, (16,)), torch.rand(16)), "index_select"),
    (embed, (torch.randn(10, 6), torch.randint(0, 10, (2, 3)), torch.randn(3, 6)), "embedding"),
    (columns, (torch.randn(3, 7, 2), torch.tensor([-1, 2, 0, 6])), "index"),
    (gather_per_element, (torch.randn(4, 7), torch.randint(0, 7, (4, 3))), "gather"),
    (gathered_row_sums, (torch.randn(9, 33), torch.randint(0, 9, (5,))), "index"),
]


@pytest.mark.parametrize("backend", ["triton", "cpp"])
@pytest.mark.parametrize("fn,args,op", GATHERS, ids=[f.__name__ for f, _, _ in GATHERS])
def test_gather_is_computed_by_the_kernel_reading_it(fn, args, op, backend):
    graphs, line = _run(fn, args, backend)
    kernels, calls = _kernels_and_calls(graphs, op)
    assert kernels and not calls, f"{[g.externs for g in graphs]}\n{line}"
    check = ("index out of bounds", "debug=True") if backend == "triton" else ("&ember_bad_row", "return ember_bad_row")
    assert all(all(c in k.source for c in check) for k in kernels), line


SCATTER_ADDS = [
    (
        graph_convolution,
        (torch.randn(8, 4), torch.randn(4, 4), torch.randn(4), torch.randint(0, 8, (2, 20)), torch.rand(20)),
        "scatter_add",
    ),
    (combine_experts, (torch.randn(9, 4), torch.randint(0, 6, (9,)), torch.rand(9)), "index_add"),
    (accumulate_rows, (torch.tensor([1, -1, 3, 3, 9]), torch.randn(5, 4)), "index_put"),
    (add_into_computed, (torch.randn(5, 3), torch.randint(0, 5, (7, 3)), torch.randn(7, 3)), "scatter_add"),
]


@pytest.mark.parametrize("fn,args,op", SCATTER_ADDS, ids=[f.__name__ for f, _, _ in SCATTER_ADDS])
def test_scatter_add_stays_an_aten_call_on_the_cpp_target(fn, args, op):
    graphs, line = _run(fn, args, "cpp")  # its Target adds nothing atomically (backends/cpp.py says why)
    kernels, calls = _kernels_and_calls(graphs, op)
    assert calls and not kernels, f"{[g.externs for g in graphs]}\n{line}"


@pytest.mark.parametrize("fn,args,op", SCATTER_ADDS, ids=[f.__name__ for f, _, _ in SCATTER_ADDS])
def test_scatter_add_is_added_atomically_by_the_kernel_computing_the_values(fn, args, op):
    graphs, line = _run(fn, args)
    kernels, calls = _kernels_and_calls(graphs, op)
    assert kernels and not calls, f"{[g.externs for g in graphs]}\n{line}"
    assert all("tl.atomic_add" in k.source for k in kernels), line


def test_graph_convolution_is_one_kernel_from_gather_to_scatter():
    args = (torch.randn(8, 4), torch.randn(4, 4), torch.randn(4), torch.randint(0, 8, (2, 20)), torch.rand(20))
    graphs, line = _run(graph_convolution, args)
    fused = [k for k in _kernels_and_calls(graphs, "scatter_add")[0] if "index_select" in k.ops]
    assert fused, f"{[(k.name, k.ops) for g in graphs for k in g.kernels]}\n{line}"


def test_graph_convolution_gradients_match_eager():
    torch.manual_seed(0)
    x, edges, weight = torch.randn(8, 4), torch.randint(0, 8, (2, 20)), torch.rand(20)
    w, b = torch.randn(4, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    w2, b2 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch._dynamo.reset()
    with collecting() as report:
        out, _ = ember_compile(graph_convolution, "triton")(x, w, b, edges, weight)
        out.square().sum().backward()
    graph_convolution(x, w2, b2, edges, weight)[0].square().sum().backward()
    line = repro(backend="triton", device="cpu", fn="graph_convolution backward")
    assert_close(w.grad, w2.grad, **TOL, what="w.grad", line=line)
    assert_close(b.grad, b2.grad, **TOL, what="b.grad", line=line)
    # The backward's gather (scatter_add's gradient) and index_add (index_select's) run in kernels.
    calls = [e for g in report.graphs for e in g.externs if e in ("gather", "index_add", "scatter_add")]
    assert not calls, f"{[g.externs for g in report.graphs]}\n{line}"


@pytest.mark.parametrize(
    "fn,args,backend",
    [
        (messages, (torch.randn(8, 4), torch.randn(4, 4), torch.tensor([0, 8]), torch.rand(2)), "triton"),
        (accumulate_rows, (torch.tensor([1, 10]), torch.randn(2, 4)), "triton"),
        (messages, (torch.randn(8, 4), torch.randn(4, 4), torch.tensor([0, 8]), torch.rand(2)), "cpp"),
        (columns, (torch.randn(3, 7, 2), torch.tensor([-8, 2])), "cpp"),  # -8 wraps to -1: out of range
    ],
    ids=["gather", "scatter_add", "gather_cpp", "negative_cpp"],
)
def test_position_out_of_range_raises(fn, args, backend):
    torch._dynamo.reset()
    with pytest.raises(Exception, match="index out of bounds"):
        ember_compile(fn, backend)(*args)


def test_settings_off_and_deterministic_mode_keep_the_aten_calls():
    args = (torch.randn(8, 4), torch.randn(4, 4), torch.randn(4), torch.randint(0, 8, (2, 20)), torch.rand(20))
    graphs, line = _run(graph_convolution, args, gathers=False, scatter_adds=False)
    assert _kernels_and_calls(graphs, "index_select")[1] and _kernels_and_calls(graphs, "scatter_add")[1], line
    torch.use_deterministic_algorithms(True)
    try:
        graphs, line = _run(combine_experts, (torch.randn(9, 4), torch.randint(0, 6, (9,)), torch.rand(9)))
    finally:
        torch.use_deterministic_algorithms(False)
    kernels, calls = _kernels_and_calls(graphs, "index_add")
    assert calls and not kernels, line  # repeated rows are added in ATen's defined order


def test_gathered_rows_are_read_along_their_features():
    """The innermost loop walks a gathered row's features (contiguous), not the edges (rows scattered
    over the source): the source, the largest buffer, is the reference for the loop order."""
    args = (torch.randn(64, 32), torch.randn(32, 32), torch.randn(32), torch.randint(0, 64, (2, 16)), torch.rand(16))
    graphs, line = _run(graph_convolution, args)
    (scatter,) = [k for k in _kernels_and_calls(graphs, "scatter_add")[0] if "index_select" in k.ops]
    assert "(xindex) % 32" in scatter.source, f"{scatter.source}\n{line}"


def initial_computed_alike(x, idx, src):
    return (x * 2).scatter_add(0, idx, src * 3)  # the index has x's shape: one domain for both


def initial_ones(idx, src):
    return torch.ones(6, 4).index_add(0, idx, src * 2)  # six rows added into six rows


def chained_adds(i, j, s1, s2):
    return torch.zeros(6, 4).index_add(0, i, s1 * 2).index_add(0, j, s2 * 3)


@pytest.mark.parametrize(
    "fn,args",
    [
        (initial_computed_alike, (torch.randn(5, 3), torch.randint(0, 5, (5, 3)), torch.randn(5, 3))),
        (initial_ones, (torch.randint(0, 6, (6,)), torch.randn(6, 4))),
        (chained_adds, (torch.randint(0, 6, (6,)), torch.randint(0, 6, (6,)), torch.randn(6, 4), torch.randn(6, 4))),
    ],
    ids=["computed_alike", "ones", "chained"],
)
def test_scatter_add_initial_value_is_computed_before_the_kernel_adding_into_it(fn, args):
    _run(fn, args)  # the initial value's kernel must not be the adding kernel: the host copies it in first


def gather_past_cat(a, b, idx):
    return torch.cat([a, b * 2])[idx]


def gather_past_pad(x, idx):
    return torch.nn.functional.pad(x * 2, (0, 0, 1, 2))[idx]


def gather_same_row(x):
    return x.index_select(0, torch.zeros(5, dtype=torch.long)) + 1  # every position reads row 0


def gather_last_row(x):
    return x[torch.full((3,), -1)] * 2


def select_by_scalar_index(x, i):
    """A 0-d index: the gathered load's pointer is one value for the whole kernel (Triton needs it as a block
    for the mask: compiled Triton and its interpreter refused the kernel)."""
    return torch.index_select(x, 0, i) * 2


@pytest.mark.parametrize("backend", ["triton", "cpp"])
@pytest.mark.parametrize(
    "fn,args",
    [
        (gather_past_cat, (torch.randn(3, 4), torch.randn(2, 4), torch.tensor([4, 0, 3]))),
        (gather_past_pad, (torch.randn(3, 4), torch.tensor([0, 1, 5, 3]))),
        (gather_same_row, (torch.randn(4, 3),)),
        (gather_last_row, (torch.randn(4, 3),)),
        (select_by_scalar_index, (torch.randn(5), torch.tensor(2))),
    ],
    ids=["cat", "pad", "same_row", "last_row", "scalar_index"],
)
def test_gathers_at_positions_and_constant_rows(fn, args, backend):
    _run(fn, args, backend)


def broadcast_source(x, idx):
    return (x.expand(10, 4) + 1).index_select(0, idx)  # the source is the same along the gathered dim


def zeros_source(idx):
    return torch.zeros(4, 3)[idx]


@pytest.mark.parametrize("backend", ["triton", "cpp"])
@pytest.mark.parametrize(
    "fn,args",
    [(broadcast_source, (torch.randn(1, 4), torch.tensor([0, 12]))), (zeros_source, (torch.tensor([0, 7]),))],
    ids=["broadcast", "zeros"],
)
def test_rows_a_source_does_not_vary_along_are_still_checked(fn, args, backend):
    torch._dynamo.reset()
    with pytest.raises(Exception, match="index out of bounds"):
        ember_compile(fn, backend)(*args)


def test_cpp_target_keeps_aten_for_stores_at_rows():
    """Its kernels report a bad row after the loop: a store into the caller's tensor would have changed it."""

    def write(cache, pos, k):
        cache.index_copy_(1, pos, k * 2)

    cache, pos, k = torch.zeros(2, 8, 4), torch.tensor([5, 1]), torch.randn(2, 2, 4)
    want = cache.clone()
    write(want, pos, k)
    graphs, line = _run(write, (cache, pos, k), "cpp")  # the eager call it compares with writes the same rows
    assert_close(cache, want, **TOL, what="cache", line=line)
    assert _kernels_and_calls(graphs, "index_copy")[1], f"{[g.externs for g in graphs]}\n{line}"


@pytest.mark.parametrize("backend", ["triton", "cpp"])
def test_dynamic_sizes(backend):
    """One compile serves graphs of other node and edge counts: the rows' bounds are size symbols."""
    torch._dynamo.reset()
    compiled = ember_compile(graph_convolution, backend, dynamic=True)
    for nodes, edges in [(8, 16), (13, 40), (30, 7)]:
        args = (torch.randn(nodes, 4), torch.randn(4, 4), torch.randn(4), torch.randint(0, nodes, (2, edges)))
        args = (*args, torch.rand(edges))
        line = repro(backend=backend, device="cpu", fn="graph_convolution", nodes=nodes, edges=edges)
        for got, want in zip(compiled(*args), graph_convolution(*args)):
            assert_close(got, want, **TOL, what="result", line=line)


def pick_targets(logits, labels):
    return -logits.log_softmax(-1)[torch.arange(logits.shape[0]), labels]  # a hand-written cross-entropy


def broadcast_pairs(x, i, j):
    return x[:, i, j] * 2  # [3, 1] and [1, 2] positions broadcast to [3, 2]; -1 is the last row


@pytest.mark.parametrize("backend", ["triton", "cpp"])
@pytest.mark.parametrize(
    "fn,args",
    [
        (pick_targets, (torch.randn(5, 9), torch.randint(0, 9, (5,)))),
        (broadcast_pairs, (torch.randn(2, 4, 6), torch.tensor([[0], [-1], [2]]), torch.tensor([[5, -6]]))),
    ],
    ids=["pick_targets", "broadcast_pairs"],
)
def test_indexing_by_several_adjacent_tensors_is_one_gather(fn, args, backend):
    graphs, line = _run(fn, args, backend)
    kernels, calls = _kernels_and_calls(graphs, "index")
    assert kernels and not calls, f"{[g.externs for g in graphs]}\n{line}"


@pytest.mark.parametrize("backend", ["triton", "cpp"])
def test_each_of_several_index_tensors_is_checked(backend):
    torch._dynamo.reset()
    with pytest.raises(Exception, match="index out of bounds"):
        ember_compile(broadcast_pairs, backend)(torch.randn(2, 4, 6), torch.tensor([[0], [1]]), torch.tensor([[1, 6]]))


@pytest.mark.parametrize("backend", ["triton", "cpp"])
def test_one_row_selected_and_its_gradient_added_back(backend):
    """A one-element index over a one-element source (an OpInfo sample): the gathered load and the gradient's
    scatter-add reach one row each, whose pointer is one value for the whole Triton kernel."""
    x, i = torch.randn(1, requires_grad=True), torch.tensor([0])
    (got,) = torch.autograd.grad(ember_compile(torch.index_select, backend)(x, 0, i).sum() * 3, x)
    (want,) = torch.autograd.grad(torch.index_select(x, 0, i).sum() * 3, x)
    assert_close(got, want, **TOL, what="gradient", line=repro(backend=backend))
