"""The scheduler on hand-built ember Graphs (no torch.compile, no device): how many kernels,
what each stores, and which merges it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch

from ember import config
from ember.backends.triton import TritonBackend
from ember.codegen.cpp import render_cpp
from ember.codegen.triton import render_triton
from ember.ir.graph import Graph, verify
from ember.ir.sizes import contiguous_strides
from ember.ir.views import VIEW_KINDS
from ember.schedule.scheduler import schedule
from ember.schedule.steps import AliasStep, ExternStep, KernelStep
from ember.target import RealizeHeuristics, Target

I = sympy.Integer
F32 = torch.float32
TRITON = TritonBackend().target()  # through Triton's CPU interpreter
CPP = Target("cpp")  # the C++ code generator's default heuristics


class G:
    """A tiny builder over ember.ir.graph.Graph."""

    def __init__(self):
        self.g = Graph(torch.device("cpu"))

    def input(self, *shape, dtype=F32):
        shape = tuple(I(s) if isinstance(s, int) else s for s in shape)
        return self.g.add_input(shape, dtype, contiguous_strides(shape))

    def pw(self, fn, *inputs, shape=None, dtype=F32, **attrs):
        shape = shape or max((v.shape for v in inputs if hasattr(v, "shape")), key=len)
        return self.g.add("pointwise", inputs, {"fn": fn, **attrs}, [(shape, dtype, None)], origin=fn).out

    def reduce(self, kind, x, dims, keepdim=False):
        shape = tuple((I(1) if keepdim else None) if d in dims else s for d, s in enumerate(x.shape))
        shape = tuple(s for s in shape if s is not None)
        attrs = {"kind": kind, "dims": tuple(dims), "keepdim": keepdim}
        return self.g.add("reduce", [x], attrs, [(shape, x.dtype, None)], origin=kind).out

    def view(self, kind, base, **attrs):
        shape = VIEW_KINDS[kind].shape(base.shape, attrs)
        return self.g.add("view", [base], {"kind": kind, **attrs}, [(shape, base.dtype, None)], origin=kind).out

    def extern(self, *inputs, shape):
        node = self.g.add(
            "extern",
            list(inputs),
            {"target": None, "args": inputs, "kwargs": {}},
            [(shape, F32, contiguous_strides(shape))],
            origin="mm",
        )
        return node.out

    def schedule(self, *outputs, **options):
        self.g.outputs = list(outputs)
        verify(self.g)
        with config.override(**options):
            sched = schedule(self.g)
        for k in sched.kernels:  # every scheduled kernel must also render, for both languages
            assert k.name in render_cpp(k, CPP)[0]
            assert k.name in render_triton(k, TRITON).source
        return sched


def _softmax(b: G, x):
    m = b.reduce("max", x, (1,), keepdim=True)
    e = b.pw("exp", b.pw("sub", x, m))
    return b.pw("truediv", e, b.reduce("sum", e, (1,), keepdim=True))


def test_pointwise_chain_is_one_kernel():
    b = G()
    x = b.input(8, 32)
    y = b.pw("add", b.pw("mul", b.pw("maximum", x, 0.0), 0.5), 1.0)
    sched = b.schedule(y)
    (k,) = sched.kernels
    assert k.writes == [y] and k.reads == [x]  # intermediates are never stored


def test_softmax_is_one_kernel():
    b = G()
    x = b.input(8, 32)
    y = _softmax(b, x)
    (k,) = b.schedule(y).kernels
    assert k.writes == [y] and k.reads == [x]
    assert sorted(r.kind for r in k.reduces) == ["max", "sum"]


def test_softmax_unfused_is_one_kernel_per_realized_value():
    b = G()
    y = _softmax(b, b.input(8, 32))
    kernels = b.schedule(y, fuse=False).kernels
    # max; sum; the output. exp(x - max) is read by two consumers but built from one buffer of its
    # size (the row max is 32x smaller, re-read from cache): recomputed in each, not realized.
    assert len(kernels) == 3, [k.writes for k in kernels]
    assert all(len(k.writes) == 1 for k in kernels)


def test_siblings_reading_one_input_share_a_kernel():
    b = G()
    x = b.input(8, 32)
    y1, y2 = b.pw("exp", x), b.pw("mul", x, 2.0)
    (k,) = b.schedule(y1, y2).kernels
    assert set(k.writes) == {y1, y2}


def test_stored_pointwise_and_its_reduction_share_a_kernel():
    b = G()
    x = b.input(8, 32)
    y = b.pw("mul", x, 2.0)
    s = b.reduce("sum", y, (1,))
    (k,) = b.schedule(y, s).kernels
    assert set(k.writes) == {y, s}


def test_layernorm_statistics_share_a_kernel():
    """mean, then the sum of squared deviations from it, then normalize: one kernel, three phases."""
    b = G()
    x = b.input(8, 32)
    mean = b.pw("truediv", b.reduce("sum", x, (1,), keepdim=True), 32)
    d = b.pw("sub", x, mean)
    var = b.pw("truediv", b.reduce("sum", b.pw("mul", d, d), (1,), keepdim=True), 32)
    y = b.pw("mul", d, b.pw("rsqrt", b.pw("add", var, 1e-5)))
    (k,) = b.schedule(y).kernels
    assert k.num_phases == 3


def test_full_reduction_then_normalize_is_one_kernel():
    b = G()
    x = b.input(8, 32)
    total = b.reduce("sum", x, (0, 1))
    y = b.pw("truediv", x, total)
    assert len(b.schedule(y).kernels) == 1


def test_reduction_read_off_its_row_is_not_fused():
    """s[i] = sum_j x[i, j] read as s[j] by x[i, j] + s[j]: a kernel per row cannot see other rows' sums."""
    b = G()
    x = b.input(8, 8)
    s = b.reduce("sum", x, (1,))
    y = b.pw("add", x, s)  # s broadcasts along the rows: indexed by the column
    sched = b.schedule(y)
    assert len(sched.kernels) == 2
    assert any(not d.accepted and "row" in d.reason for d in sched.decisions), sched.decisions


def test_reductions_over_different_dims_are_separate_kernels():
    b = G()
    x = b.input(8, 16)
    assert len(b.schedule(b.reduce("sum", x, (0,)), b.reduce("sum", x, (1,))).kernels) == 2


def test_extern_splits_the_program():
    b = G()
    x = b.input(8, 16)
    w = b.input(16, 4)
    h = b.pw("maximum", b.pw("mul", x, 2.0), 0.0)
    mm = b.extern(h, w, shape=(I(8), I(4)))
    y = b.pw("add", mm, 1.0)
    steps = b.schedule(y).steps
    kinds = [type(st).__name__ for st in steps]
    assert kinds == ["KernelStep", "ExternStep", "KernelStep"], kinds
    assert steps[0].kernel.writes == [h]  # the extern's input is materialized
    assert isinstance(steps[1], ExternStep)


def test_permuted_input_is_read_in_place():
    b = G()
    x = b.input(8, 32)
    y = b.pw("add", b.view("permute", x, dims=(1, 0)), 1.0)
    (k,) = b.schedule(y).kernels
    assert k.reads == [x]


def test_view_chain_into_reduction_is_one_kernel():
    """(x.t() + 1).sum(0) without a transpose copy."""
    b = G()
    x = b.input(16, 24)
    t = b.view("permute", x, dims=(1, 0))
    s = b.reduce("sum", b.pw("add", t, 1.0), (0,))
    (k,) = b.schedule(s).kernels
    assert k.reads == [x]


def test_view_of_a_computed_output_is_an_alias():
    b = G()
    x = b.input(4, 6)
    y = b.pw("mul", x, 2.0)
    t = b.view("permute", y, dims=(1, 0))
    sched = b.schedule(t)
    assert len(sched.kernels) == 1
    aliases = [st for st in sched.steps if isinstance(st, AliasStep)]
    assert len(aliases) == 1 and aliases[0].base is y and tuple(aliases[0].stride) == (1, 6)


def test_symbolic_sizes_pointwise_is_one_kernel():
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    b = G()
    x = b.input(s0, 32)
    y = b.pw("tanh", b.pw("mul", x, 3.0))
    (k,) = b.schedule(y).kernels
    assert s0 in k.size_symbols()


def test_symbolic_softmax_is_one_kernel():
    s0, s1 = (sympy.Symbol(n, integer=True, positive=True) for n in ("s0", "s1"))
    b = G()
    x = b.input(s0, s1)
    assert len(b.schedule(_softmax(b, x)).kernels) == 1


@pytest.mark.parametrize("shape,dims", [((8, 32), (1,)), ((8, 32), (0,)), ((4, 6, 8), (0, 2)), ((4, 6, 8), (0, 1, 2))])
def test_reduction_domains(shape, dims):
    b = G()
    x = b.input(*shape)
    r = b.reduce("sum", b.pw("exp", x), dims)
    (k,) = b.schedule(r).kernels
    assert k.domain.reduce_dims == tuple(dims)
    assert all(kind == "KernelStep" for kind in (type(st).__name__ for st in b.schedule(r).steps))


def test_schedule_orders_producers_first():
    b = G()
    x = b.input(8, 8)
    s = b.reduce("sum", x, (1,))
    y = b.pw("add", x, s)  # not fusable (see above): the sum's kernel must come first
    steps = [st for st in b.schedule(y).steps if isinstance(st, KernelStep)]
    assert s in steps[0].kernel.writes and y in steps[1].kernel.writes


def test_shared_pointwise_is_stored_only_when_that_moves_fewer_bytes():
    # A value read by two kernels (a column sum and a pointwise consumer): realized (computed once,
    # a kernel of its own when nothing fuses) when re-reading its inputs in both would move more
    # bytes than writing it once and reading it back.
    BF16, F32 = torch.bfloat16, torch.float32

    def stored(dtype_in, dtype_out, mask: bool) -> bool:
        b = G()
        first = b.input(64, 256, dtype=torch.bool if mask else dtype_in)
        second = b.input(64, 256, dtype=dtype_in)
        if mask:  # batch norm backward's where(relu_mask, 0, grad)
            v = b.pw("where", first, 0.0, second, dtype=dtype_out)
        else:  # a residual sum
            v = b.pw("add", first, second, dtype=dtype_out)
        col = b.reduce("sum", v, (0,))
        out = b.pw("mul", v, b.input(64, 256, dtype=dtype_out), dtype=dtype_out)
        return any(v in k.writes for k in b.schedule(col, out, fuse=False).kernels)

    assert not stored(BF16, BF16, mask=True)  # 1 + 2 bytes in, 2 out: recomputed by both readers
    assert stored(F32, F32, mask=False)  # 4 + 4 bytes in, 4 out: a tie, stored
    assert stored(BF16, BF16, mask=False)  # 2 + 2 in, 2 out: a tie, stored
    assert not stored(F32, F32, mask=True)  # 1 + 4 in, 4 out


def test_only_the_sibling_merges_live_at_a_raised_peak_are_refused():
    # q = -x feeds a chain of big externs; p = exp(x) is read only at the end. Merged as siblings
    # (both read x), p would be computed with q and held through the chain: 12 MB where eager
    # peaks at 8. The row sum and max of x are siblings too, but small and not live at the peak:
    # they stay one kernel (refusing every sibling merge once split them).
    b = G()
    n = 1024
    x = b.input(n, n)
    q = b.pw("neg", x)
    e1 = b.extern(q, shape=(I(n), I(n)))
    e3 = b.extern(e1, shape=(I(n), I(n)))
    e4 = b.extern(e3, shape=(I(n), I(1)))
    p = b.pw("exp", x)
    e2 = b.extern(p, shape=(I(n), I(1)))
    total, largest = b.reduce("sum", x, (1,)), b.reduce("max", x, (1,))
    sched = b.schedule(e4, e2, total, largest)
    assert sched.memory.peak_bytes <= sched.memory.eager_peak_bytes * 1.01 + (1 << 20), sched.memory
    kernels = sched.kernels
    by_value = {v: k for k in kernels for v in k.writes}
    assert by_value[q] is not by_value[p], [(k.name, k.origins) for k in kernels]
    assert by_value[total] is by_value[largest], [(k.name, k.origins) for k in kernels]
    refusals = [d.reason for d in sched.decisions if "sibling merges refused" in d.reason]
    assert refusals and all("live at the peak" in r for r in refusals), refusals


def test_transcendental_value_broadcast_over_heads_is_computed_once():
    """Rotary embeddings: cos and sin of a [tokens, dims] angle table multiply q of [heads, tokens,
    dims]. Inlined, every head would evaluate them again; they are computed once, in a small kernel,
    and the kernel over q reads them."""
    b = G()
    angles, q = b.input(16, 8), b.input(4, 16, 8)
    cos, sin = b.pw("cos", angles), b.pw("sin", angles)
    wide = lambda v: b.view("expand", b.view("unsqueeze", v, dim=0), shape=(I(4), I(16), I(8)))
    y = b.pw("add", b.pw("mul", q, wide(cos)), b.pw("mul", q, wide(sin)))
    kernels = b.schedule(y).kernels
    (big,) = [k for k in kernels if y in k.writes]
    assert cos in big.reads and sin in big.reads, [(k.writes, k.reads) for k in kernels]
    source = render_triton(big, TRITON).source
    assert "tl.cos" not in source and "tl.sin" not in source, source


def test_cheap_or_same_size_values_stay_inlined():
    """Only transcendental work read over a much larger domain is computed apart: a scale read over
    the heads (one multiply) and a sin read at its own size stay inside the one kernel."""
    b = G()
    t, q = b.input(16, 8), b.input(4, 16, 8)
    scale = b.pw("mul", t, 2.0)
    wide = b.view("expand", b.view("unsqueeze", scale, dim=0), shape=(I(4), I(16), I(8)))
    y = b.pw("mul", q, wide)
    (k,) = b.schedule(y).kernels
    assert k.reads == [q, t] or k.reads == [t, q], k.reads
    z = b.pw("mul", b.pw("sin", t), t)
    (k2,) = b.schedule(z).kernels
    assert k2.reads == [t]


def test_broadcast_rule_weighs_the_work_saved_against_a_launch():
    """With the target's rates known, a value is computed apart only where the redundant work
    outlasts a launch; an expression of huge cost (chained squarings) is capped, not an overflow."""
    from ember.schedule.realize import MAX_WORK, costly_to_broadcast

    gpu = Target("triton", "cuda", flop_rate=67e12, launch_seconds=4e-6)
    assert costly_to_broadcast(48, 16 * 1024, 50_000_000, gpu)  # rotary tables over a fused q/k/v gradient
    assert not costly_to_broadcast(48, 64, 2048, gpu)  # a few thousand sines: a launch costs more
    assert not costly_to_broadcast(4, 64, 50_000_000, gpu)  # one rsqrt: stays inlined
    assert costly_to_broadcast(MAX_WORK, 16, 4096 * 16, Target("none"))  # no rates: the size rule alone
    b = G()
    t, q = b.input(16), b.input(4096, 16)
    y = t
    for _ in range(1030):
        y = b.pw("mul", y, y)
    out = b.pw("add", q, b.view("expand", b.view("unsqueeze", b.pw("sin", y), dim=0), shape=(I(4096), I(16))))
    assert b.schedule(out).kernels  # scheduled, no OverflowError


def test_a_scalar_s_transcendental_work_stays_in_triton_kernels_and_is_computed_apart_in_cpp():
    """An optimizer's bias correction, 1 - 0.9 ** step over a 0-d step, broadcast over a large parameter:
    Triton kernels compute a 0-d value as a scalar, once a thread, so it stays inlined there (every
    parameter's update keeps one body); the C++ target's loop would evaluate it in each iteration, so there
    it is computed apart, once."""
    from ember.schedule.realize import costly_to_broadcast

    gpu = Target("triton", "cuda", flop_rate=67e12, launch_seconds=4e-6)
    assert costly_to_broadcast(48, 1, 50_000_000, gpu)  # a 0-d value, where scalars cost one an element
    scalar_once = dataclasses.replace(
        gpu, heuristics=dataclasses.replace(gpu.heuristics, realize=RealizeHeuristics(scalars_per_element=False))
    )
    assert not costly_to_broadcast(48, 1, 50_000_000, scalar_once)
    assert costly_to_broadcast(48, 16 * 1024, 50_000_000, scalar_once)  # rotary tables are not scalars

    from ember.backends.cpp import CppBackend

    b = G()
    step, p = b.input(), b.input(1 << 20)
    correction = b.pw("sub", 1.0, b.pw("pow", 0.9, step), shape=())
    b.g.outputs = [b.pw("truediv", p, b.view("expand", correction, shape=(I(1 << 20),)))]
    verify(b.g)
    (triton,) = [k for k in schedule(b.g, target=TRITON).kernels if b.g.outputs[0] in k.writes]
    assert step in triton.reads and correction not in triton.reads, triton.reads
    (loop,) = [k for k in schedule(b.g, target=CppBackend().target()).kernels if b.g.outputs[0] in k.writes]
    assert correction in loop.reads, loop.reads


def test_cpp_computes_once_a_value_that_many_window_terms_read():
    """A max pool's window terms each read the batch norm + ReLU before it: the C++ target stores that
    activation once (inlined, each term recomputed it through loads that do not vectorize); the Triton
    target keeps it inlined."""

    def pooled():
        b = G()
        x, mean, scale, shift = b.input(8, 34), b.input(8, 1), b.input(8, 1), b.input(8, 1)
        act = b.pw("maximum", b.pw("add", b.pw("mul", b.pw("sub", x, mean), scale), shift), 0.0)
        terms = [b.view("slice", act, dim=1, start=I(k), end=I(k + 32), step=I(1)) for k in range(3)]
        terms += [b.pw("mul", t, 1.0) for t in terms]  # six readers, as a pool's window terms
        out = terms[0]
        for t in terms[1:]:
            out = b.pw("maximum", out, t)
        b.g.outputs = [out]
        verify(b.g)
        return b.g, act

    from ember.backends.cpp import CppBackend

    g, act = pooled()
    cpp_kernels = schedule(g, target=CppBackend().target()).kernels
    assert any(act in k.writes for k in cpp_kernels), [k.writes for k in cpp_kernels]
    g, act = pooled()
    triton_kernels = schedule(g, target=TRITON).kernels
    assert not any(act in k.writes for k in triton_kernels), [k.writes for k in triton_kernels]
