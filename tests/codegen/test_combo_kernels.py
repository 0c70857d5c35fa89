"""Combo kernels (schedule/horizontal.py; codegen/triton_combo.py, codegen/cpp_combo.py): programs of
many independent in-place pointwise updates, compiled, equal eager's results with a launch count
that does not grow with the tensor count. On both code generators (Triton through its interpreter,
at tiny shapes), and with Triton on a GPU where one is present. Triton runs parts of one body as a
table combo kernel (one body, each part's addresses read from a table: backends/table_launch.py)."""

from __future__ import annotations

import math

import pytest
import torch

from ember.backends.table_launch import TableLaunch
from tests.helpers import ON_DEVICES, assert_close, assert_no_fallback, ember_compile, reports

# 20 tensors of mixed sizes and ranks; every third parameter is bf16 with fp32 state.
SIZES = [(7,), (33,), (128,), (300,), (5,), (4, 9), (64,), (3, 5, 2), (17,), (11,)] * 2
CAP = 8


def momentum_step(params, grads, states):
    """A foreach-style SGD-with-momentum step, one tensor at a time: m = 0.9 m + 0.1 g (fp32 state);
    p -= 0.05 m (in p's dtype)."""
    for p, g, m in zip(params, grads, states):
        m.mul_(0.9).add_(g.float(), alpha=0.1)
        p.add_(m.to(p.dtype), alpha=-0.05)


def _tensors(device):
    dtypes = [torch.bfloat16 if k % 3 == 0 else torch.float32 for k in range(len(SIZES))]
    params = [torch.randn(s, device=device, dtype=dt) for s, dt in zip(SIZES, dtypes)]
    grads = [torch.randn(s, device=device, dtype=dt) for s, dt in zip(SIZES, dtypes)]
    states = [torch.randn(s, device=device) for s in SIZES]
    return params, grads, states


def _two_steps(params, grads, states, backend, line, **options):
    """Two compiled momentum steps beside two eager ones on copies: the graph's report, and the copies."""
    want = [[t.clone() for t in ts] for ts in (params, grads, states)]
    compiled = ember_compile(momentum_step, backend, **options)
    with reports() as report:
        for _ in range(2):
            compiled(params, grads, states)
            momentum_step(*want)
    assert_no_fallback(report, line)
    (graph,) = report.graphs
    return graph, want


@pytest.mark.parametrize("backend,device", ON_DEVICES)
def test_foreach_style_updates_of_twenty_mixed_tensors_take_ceil_20_over_cap_launches(backend, device):
    params, grads, states = _tensors(device)
    line = f"repro: momentum step over 20 tensors {SIZES[:10]} x2, bf16 every third, cap {CAP}, {backend} on {device}"
    graph, want = _two_steps(params, grads, states, backend, line, heuristics=f"horizontal.max_parts={CAP}")
    if backend == "cpp":
        assert len(graph.kernels) <= math.ceil(len(SIZES) / CAP), [k.name for k in graph.kernels]
    else:  # one table launch per body, whatever the cap: {bf16, fp32} x {count a multiple of 16, not}
        assert len(graph.kernels) == 4, [k.name for k in graph.kernels]
        assert all("part_of_block" in k.source for k in graph.kernels), graph.kernels[0].source
    assert f"{2 * len(SIZES)} mutated inputs written in place" in graph.memory, graph.memory
    if backend == "triton":  # each tensor passed once: a parameter written in place is not passed again
        launches = [ln for ln in graph.host_source.splitlines() if "_tables_" in ln]
        assert sum(ln.count(", a") for ln in launches) == 3 * len(SIZES), launches
        assert "buf" not in "".join(launches), launches
    for k, (got, ref) in enumerate(zip(params + states, want[0] + want[2])):
        tol = 1e-2 if got.dtype == torch.bfloat16 else 1e-5
        what = f"{'param' if k < len(SIZES) else 'state'} {k % len(SIZES)} {tuple(got.shape)} {got.dtype}"
        assert_close(got, ref, rtol=tol, atol=tol, what=what, line=line)


def scattered_updates(x, s, v, w):
    """Parts of several shapes: a transposed read (two loop dims), a 0-d counter, a flat update and a
    bf16 one, none reading another's result."""
    y = x.t() * 2.0
    s.add_(1)
    v.mul_(0.5).add_(1.0)
    w.sub_(0.25)
    return y


@pytest.mark.parametrize("backend,device", ON_DEVICES)
def test_parts_of_other_ranks_a_counter_and_many_work_items(backend, device):
    """Work items of 16 elements, and a 300-element part over a 64-element threshold: the C++ combo
    kernel hands its parts' chunks to OpenMP threads; a transposed part and a 0-d part run in the
    same launch."""
    x = torch.randn(40, 9, device=device)
    args = [x, torch.zeros((), device=device), torch.randn(300, device=device)]
    args.append(torch.randn(50, device=device, dtype=torch.bfloat16))
    want = [a.clone() for a in args]
    line = f"repro: transposed, 0-d, flat and bf16 updates in one launch, {backend} on {device}"
    tuned = "horizontal.cpu_item_elements=16,cpp.parallel_threshold=64"
    compiled = ember_compile(scattered_updates, backend, heuristics=tuned)
    with reports() as report:
        got_y = compiled(*args)
    want_y = scattered_updates(*want)
    assert_no_fallback(report, line)
    (graph,) = report.graphs
    assert len(graph.kernels) == 1, [k.name for k in graph.kernels]
    if backend == "cpp":
        assert "omp parallel for schedule(dynamic, 1)" in graph.kernels[0].source, graph.kernels[0].source
    assert_close(got_y, want_y, rtol=1e-6, atol=1e-6, what="y", line=line)
    for name, got, ref in zip(("x", "s", "v", "w"), args, want):
        assert_close(got, ref, rtol=1e-6, atol=1e-6, what=name, line=line)


@pytest.mark.parametrize("backend,device", [p for p in ON_DEVICES if p.values[0] == "triton"])
def test_table_kernel_over_unaligned_views_takes_its_form_for_any_address(backend, device, monkeypatch):
    """Parameters that are views one element into a shared buffer (4-byte aligned, not 16): the table
    kernel's form that assumes aligned addresses must not run; the results equal eager's."""
    sizes = [(48,), (32,), (64,), (16,)]
    flat = torch.randn(1 + sum(math.prod(s) for s in sizes), device=device)
    offsets = [1 + sum(math.prod(s) for s in sizes[:k]) for k in range(len(sizes))]
    params = [flat[o : o + math.prod(s)].view(s) for o, s in zip(offsets, sizes)]
    grads = [torch.randn(s, device=device) for s in sizes]
    states = [torch.randn(s, device=device) for s in sizes]
    line = f"repro: momentum step over views at odd offsets {offsets} of one buffer, {backend} on {device}"
    forms = []
    made = TableLaunch.__init__

    def spy(self, source, device, fast, slow, fill):
        def fast_spy(*args):
            forms.append("aligned")
            return fast(*args)

        def slow_spy(*args):
            forms.append("any")
            return slow(*args)

        made(self, source, device, fast_spy, slow_spy, fill)

    monkeypatch.setattr(TableLaunch, "__init__", spy)
    graph, want = _two_steps(params, grads, states, backend, line)
    assert forms == ["any", "any"], forms  # the form that assumes no alignment, both calls
    assert len(graph.kernels) == 1 and "part_of_block" in graph.kernels[0].source, graph.kernels
    for k, (got, ref) in enumerate(zip(params + states, want[0] + want[2])):
        assert_close(got, ref, rtol=1e-5, atol=1e-5, what=f"tensor {k}", line=line)


def test_the_table_writing_kernel_stores_each_address_at_its_place():
    """ember_table_fill (what a CUDA graph's capture records to write an address table) through
    Triton's interpreter: the values less their bias, in order."""
    from ember.backends.triton import TritonBackend
    from ember.codegen.triton import PRELUDE
    from ember.codegen.triton_combo import TABLE_FILL_ARGS, TABLE_FILL_BIAS, TABLE_FILL_SOURCE

    module = TritonBackend()._load(PRELUDE + "\n\n" + TABLE_FILL_SOURCE + "\n")
    want = [(k * 7919) << 20 for k in range(TABLE_FILL_ARGS)]  # addresses past 32 bits, and 0
    out = torch.zeros(TABLE_FILL_ARGS + 3, dtype=torch.int64)
    module.ember_table_fill[(1,)](out, *[v + TABLE_FILL_BIAS for v in want])
    assert out.tolist() == want + [0, 0, 0]


def test_inputs_only_table_kernels_reach_are_the_programs_table_inputs(monkeypatch):
    """The host program's table inputs (codegen/host.py), which a CUDA graph replay takes where they
    are (runtime/cudagraph_pool.py): every tensor of a momentum step, read and written only by its
    table kernels; not a gradient that a kernel of its own also reads (the returned norm)."""
    from ember import pipeline

    made: list = []
    real = pipeline.CompiledGraph

    class Kept(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(pipeline, "CompiledGraph", Kept)
    params, grads, states = _tensors("cpu")
    _two_steps(params, grads, states, "triton", "repro: momentum step, triton on cpu")

    def step_and_norm(params, grads, states):
        momentum_step(params, grads, states)
        return grads[0].square().sum()

    ember_compile(step_and_norm, "triton")(params, grads, states)
    # Parts past `horizontal.max_elements` (the 128- and 300-element ones here) join their body's table too.
    torch._dynamo.reset()
    ember_compile(momentum_step, "triton", heuristics="horizontal.max_elements=100")(params, grads, states)
    step, with_norm, with_large = (m.table_inputs for m in made)
    assert step == frozenset(range(3 * len(SIZES))), sorted(step)
    # A capture sets aside a call's table rows (runtime/cudagraph_pool.py): a row per part and buffer of its
    # body (the parameter, gradient and momentum it reads, the parameter and momentum it writes), each
    # table's rounded up to an even count so that every table starts 16 bytes apart.
    rows = [v.rows_per_table for k, v in made[0].report.namespace.items() if k.startswith("_tables_")]
    assert sum(rows) == 5 * len(SIZES), rows
    assert made[0].table_rows == sum(r + r % 2 for r in rows) > sum(rows), (made[0].table_rows, rows)
    assert with_norm < step and len(step - with_norm) <= 3, sorted(step - with_norm)
    assert with_large == step, sorted(step - with_large)


def test_adamw_over_a_parameter_past_max_elements_runs_every_update_in_one_table():
    """A parameter past `horizontal.max_elements` (an embedding) takes its update's place in the one table
    launch of AdamW's updates (through Triton's interpreter), results equal to eager's: under CUDA graphs its
    gradient is then read through the table, not copied in each replay. (At GPT-2's sizes this also needs
    its bias correction inlined as a scalar like the others': tests/schedule/test_fusion.py.)"""
    torch.manual_seed(0)
    shapes = [(64, 48), (48,), (32, 16), (4096,)]  # the last one past max_elements=1024
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        p.grad = torch.randn_like(p)
        t.grad = p.grad.clone()
    opt, eager = (torch.optim.AdamW(ps, lr=0.01, foreach=True) for ps in (params, twins))
    step = ember_compile(opt.step, "triton", heuristics="horizontal.max_elements=1024")
    line = f"repro: AdamW foreach over {shapes}, triton on cpu, horizontal.max_elements=1024"
    with reports() as report:
        for _ in range(2):
            step()
            eager.step()
    assert_no_fallback(report, line)
    (graph,) = [g for g in report.graphs if g.mutations]
    updates = [k for k in graph.kernels if "part_of_block" in k.source and "sqrt" in k.source]
    assert len(updates) == 1 and all("sqrt" not in k.source for k in graph.kernels if k not in updates), (
        f"{[k.name for k in graph.kernels]}\n{line}"
    )
    for k, (got, ref) in enumerate(zip(params, twins)):
        assert_close(got.detach(), ref.detach(), rtol=1e-5, atol=1e-5, what=f"param {k} {shapes[k]}", line=line)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph's capture and replay need a GPU")
def test_adamw_under_cuda_graphs_reads_gradients_where_they_are_each_step():
    """A compiled AdamW step (foreach) in reduce-overhead mode, its gradients made anew at other
    addresses every step: the recording reads them through its rewritten address tables, copies
    none in, records once, and every parameter matches an eager twin's."""
    torch.manual_seed(0)
    shapes = [(64, 48), (48,), (300,), (7, 5), (1024,), (33, 3)] * 2
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(params, lr=0.01, foreach=True)
    eager = torch.optim.AdamW(twins, lr=0.01, foreach=True)
    step = torch.compile(opt.step, backend="ember", mode="reduce-overhead")
    line = f"repro: AdamW foreach over {len(shapes)} cuda params, reduce-overhead, new gradient addresses per step"
    spacers = []
    with reports() as report:
        for k in range(6):
            spacers.append(torch.empty(4096 * (k + 1), device="cuda"))  # moves the next allocations
            for p, t in zip(params, twins):
                g = torch.randn(p.shape, device="cuda")
                p.grad, t.grad = g, g.clone()
            step()
            eager.step()
    assert_no_fallback(report, line)
    from ember.runtime import cudagraphs as cg

    pool = cg.pool_for(cg.current_recorder(), torch.device("cuda", torch.cuda.current_device()))
    (recording,) = [r for r in pool.recordings if not r.released and r.rebound]  # recorded once
    grads = {p.grad.untyped_storage().data_ptr() for p in params}
    assert len(recording.rebound) >= len(params) and recording.tables, line
    assert len(recording.copy_in) < len(params), line  # the gradients are not among the inputs copied in
    assert all(recording.inputs[k] is None for k in recording.rebound) and len(grads) == len(params), line
    graphs = [g for g in report.graphs if g.cudagraphs.startswith("on")]
    assert graphs and all("read through address tables" in g.cudagraphs for g in graphs), [
        g.cudagraphs for g in report.graphs
    ]
    for k, (p, t) in enumerate(zip(params, twins)):
        assert_close(p, t, rtol=1e-5, atol=1e-6, what=f"param {k} {tuple(p.shape)}", line=line)
