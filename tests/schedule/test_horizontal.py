"""Horizontal fusion (schedule/horizontal.py): independent small pointwise kernels packed into
combo kernels, one launch each. Graphs are built directly; each schedule's kernels must also render
in both languages. What the combined kernels compute is checked against eager in
tests/codegen/test_combo_kernels.py."""

from __future__ import annotations

import dataclasses
import math
import types

import sympy
import torch

from ember import config
from ember.backends.triton import TritonBackend
from ember.codegen.cpp_combo import render_cpp_combo
from ember.codegen.triton_combo import render_triton_combo, render_triton_table
from ember.ir.graph import Graph, verify
from ember.ir.sizes import contiguous_strides
from ember.schedule import horizontal
from ember.schedule.horizontal import table_signature
from ember.schedule.kernel import ComboKernel, kernel_parts
from ember.schedule.memory import plan_memory
from ember.schedule.scheduler import schedule
from ember.schedule.steps import ExternStep, KernelStep
from ember.target import Heuristics, HorizontalHeuristics, Target

I = sympy.Integer
F32, BF16 = torch.float32, torch.bfloat16
TRITON = TritonBackend().target()  # through Triton's CPU interpreter


_FRESH = types.SimpleNamespace(fresh_result=True)


def target(**rules) -> Target:
    return Target("cpp", heuristics=Heuristics(horizontal=HorizontalHeuristics(**rules)))


class G:
    """A tiny builder over ember.ir.graph.Graph."""

    def __init__(self):
        self.g = Graph(torch.device("cpu"))

    def input(self, *shape, dtype=F32):
        shape = tuple(I(s) for s in shape)
        return self.g.add_input(shape, dtype, contiguous_strides(shape))

    def pw(self, fn, *inputs, dtype=None):
        shape = max((v.shape for v in inputs if hasattr(v, "shape")), key=len)
        dtype = dtype or next(v.dtype for v in inputs if hasattr(v, "dtype"))
        return self.g.add("pointwise", inputs, {"fn": fn}, [(shape, dtype, None)], origin=fn).out

    def axpb(self, x):
        return self.pw("add", self.pw("mul", x, 0.5), 1.0)

    def extern(self, x):
        """An op that returns fresh memory (no view of x): x must be in memory, and is no alias's base."""
        attrs = {"target": _FRESH, "args": (x,), "kwargs": {}}
        return self.g.add("extern", [x], attrs, [(x.shape, x.dtype, contiguous_strides(x.shape))], origin="mm").out

    def schedule(self, *outputs, mutations=(), tgt=None):
        self.g.outputs = list(outputs)
        self.g.mutations = list(mutations)
        verify(self.g)
        sched = schedule(self.g, target=tgt or target())
        for k in sched.kernels:
            if isinstance(k, ComboKernel):  # every combo kernel renders in both languages
                assert k.name in render_cpp_combo(k, tgt or target(), lambda p: frozenset())[0]
                render = render_triton_table if k.table else render_triton_combo
                assert k.name in render(k, TRITON).source
        return sched


def combos(sched) -> list[ComboKernel]:
    return [k for k in sched.kernels if isinstance(k, ComboKernel)]


def test_twenty_independent_updates_of_mixed_sizes_and_dtypes_take_ceil_20_over_cap_launches():
    b = G()
    sizes = [7, 33, 128, 1000, 5, (4, 9), 64, (3, 5, 2), 17, 300]
    xs = [
        b.input(*(s if isinstance(s, tuple) else (s,)), dtype=BF16 if k % 3 == 0 else F32)
        for k, s in enumerate(sizes * 2)
    ]
    ys = [b.axpb(x) for x in xs]
    for cap in (4, 8, 32):
        sched = b.schedule(*ys, tgt=target(max_parts=cap))
        assert len(sched.kernels) == math.ceil(20 / cap), [k.name for k in sched.kernels]
        parts = [p for k in combos(sched) for p in k.parts]
        assert sorted(v.id for p in parts for v in p.writes) == sorted(y.id for y in ys)
        assert sum(d.accepted and d.reason.startswith("horizontal") for d in sched.decisions) == len(combos(sched))


def test_one_part_per_launch_leaves_every_kernel_alone():
    b = G()
    ys = [b.axpb(b.input(16)) for _ in range(4)]
    sched = b.schedule(*ys, tgt=target(max_parts=1))
    assert len(sched.kernels) == 4 and not combos(sched)


def test_a_kernel_reading_another_never_shares_its_launch():
    """y2 reads y1 through an extern: they are never parts of one launch; the independent y3 joins
    y1's. (Read directly, y1 and y2 fuse into one kernel, which is one part.)"""
    b = G()
    x1, x3 = b.input(16), b.input(16)
    y1 = b.axpb(x1)
    y2 = b.axpb(b.extern(y1))
    y3 = b.axpb(x3)
    sched = b.schedule(y1, y2, y3)
    (combo,) = combos(sched)
    assert {v.id for v in combo.writes} == {y1.id, y3.id}, [k.name for k in sched.kernels]
    positions = {v.id: n for n, s in enumerate(sched.steps) if isinstance(s, KernelStep) for v in s.kernel.writes}
    assert positions[y2.id] > positions[y1.id]  # still after what it reads
    for combo in combos(b.schedule(y1, b.axpb(y1), y3)):
        assert all(not (y1 in p.writes) or len(p.writes) == 2 for p in combo.parts)  # y1 with its reader


def test_reductions_and_large_kernels_keep_their_own_launch():
    b = G()
    x, big = b.input(8, 16), b.input(4096)
    total = b.g.add("reduce", [x], {"kind": "sum", "dims": (1,), "keepdim": False}, [((I(8),), F32, None)]).out
    ys = [b.axpb(b.input(16)) for _ in range(3)]
    sched = b.schedule(total, b.axpb(big), *ys, tgt=target(max_elements=1024))
    (combo,) = combos(sched)
    assert {v.id for v in combo.writes} == {y.id for y in ys}
    assert len(sched.kernels) == 3  # the sum, the large kernel, the combo


def test_buffer_cap_splits_the_launches():
    b = G()
    ys = [b.axpb(b.input(16)) for _ in range(6)]  # two buffers each
    sched = b.schedule(*ys, tgt=target(max_buffers=5))
    assert [len(k.parts) for k in combos(sched)] == [2, 2, 2]


def test_writer_of_a_mutated_input_follows_its_other_readers():
    """x is mutated (its new value x * 0.5 + 1) and also read by another kernel: that reader runs
    first, in a launch of its own level, so the writer can still write x in place."""
    b = G()
    x, z = b.input(16), b.input(16)
    reader = b.pw("mul", x, 3.0)
    other = b.axpb(z)
    new_x = b.axpb(x)
    with config.override(fuse=False):  # else the reader and the writer are one kernel
        sched = b.schedule(reader, other, new_x, mutations=[(x, 2)])
    assert len(sched.kernels) == 2, [k.name for k in sched.kernels]
    for k in combos(sched):
        assert not ({reader.id, new_x.id} <= {v.id for v in k.writes}), "the reader and the writer share a launch"
    assert x in sched.memory.mutations_in_place
    # Were they parts of one launch, the writer could not write x in place: the reader might load
    # elements already overwritten. The memory plan copies the new value in at the end instead.
    (kr,) = [k for p in sched.kernels for k in kernel_parts(p) if reader in k.writes]
    (kw,) = [k for p in sched.kernels for k in kernel_parts(p) if new_x in k.writes]
    together = plan_memory(b.g, [KernelStep(ComboKernel("combo", [kr, kw]))], None)
    assert x not in together.mutations_in_place, together


def test_parts_never_write_over_what_another_part_reads():
    """t is read last by two kernels that become one combo kernel: neither part's output may take
    t's memory in place (the other part would read overwritten elements)."""
    b = G()
    t = b.axpb(b.input(64))
    e = b.extern(t)  # keeps t in memory
    a, c = b.pw("add", t, 1.0), b.pw("mul", t, 3.0)
    with config.override(fuse=False):  # a and c apart, each a kernel
        sched = b.schedule(e, a, c, tgt=target(max_parts=1))
    (ka,) = [k for k in sched.kernels if a in k.writes]
    (kc,) = [k for k in sched.kernels if c in k.writes]
    steps = [s for s in sched.steps if not (isinstance(s, KernelStep) and s.kernel in (ka, kc))]
    steps.append(KernelStep(ComboKernel("combo", [ka, kc])))
    plan = plan_memory(b.g, steps, None)
    assert plan.reuse.get(a) is not t and plan.reuse.get(c) is not t, plan.reuse
    alone = plan_memory(b.g, [s for s in steps[:-1]] + [KernelStep(ka), KernelStep(kc)], None)
    assert alone.reuse.get(c) is t  # apart, the last reader writes in place


def test_a_combination_that_raises_the_peak_is_refused():
    """y3 at level 0 would move to y1's place, ahead of a large temporary: its 4 KB output would
    live through the temporary's life. With no room for a larger peak the kernels stay apart."""
    b = G()
    y1 = b.axpb(b.input(1024))
    u = b.pw("exp", b.input(1 << 16))
    e = b.extern(b.extern(u))
    y3 = b.axpb(b.input(1024))
    sched = b.schedule(y1, e, y3, tgt=target(max_peak_increase=1))
    assert not combos(sched)
    assert any(not d.accepted and "peak" in d.reason for d in sched.decisions), sched.decisions
    relaxed = b.schedule(y1, e, y3, tgt=target())
    assert len(combos(relaxed)) == 1
    assert dataclasses.asdict(HorizontalHeuristics())  # the rules are plain data


def test_extern_calls_keep_their_order():
    """e3 reads y1 and comes before e2 in the program; packing y1 with y2 (which reads e2) would run
    e2 first. Extern calls follow each other (random number generators, asserts), so y1 and y2 stay
    apart."""
    b = G()
    y1 = b.axpb(b.extern(b.input(16)))
    e3 = b.extern(y1)
    e2 = b.extern(b.input(16))
    y2 = b.axpb(e2)
    sched = b.schedule(y1, e3, y2)
    order = [s.node.out.id for s in sched.steps if isinstance(s, ExternStep)]
    assert order == sorted(order) and e3.id in order and e2.id in order, order
    assert not combos(sched)


def test_kernels_of_one_body_take_one_table_launch_past_the_caps():
    """40 updates, bf16 and fp32, of sizes a multiple of 16 and not, with caps of 4 parts and 8
    buffers: with table launches each of the 4 bodies is one launch; a transposed read (two loop
    dims) is no table's part and stays within the caps."""
    b = G()
    sizes = [16, 48, 7, 33, 1024, 5]
    xs = [b.input(sizes[k % len(sizes)], dtype=BF16 if k % 2 else F32) for k in range(40)]
    ys = [b.axpb(x) for x in xs]
    t = b.pw("mul", b.g.add_input((I(6), I(4)), F32, (I(1), I(6))), 2.0)  # a column-major input
    u = b.pw("sub", b.input(9), 1.0)  # a body of its own
    sched = b.schedule(*ys, t, u, tgt=target(max_parts=4, max_buffers=8, table_min_parts=2))
    tables = [k for k in combos(sched) if k.table]
    assert len(tables) == 4, [(k.name, len(k.parts)) for k in combos(sched)]
    assert sorted(len(k.parts) for k in tables) == [7, 7, 13, 13]
    for k in tables:
        (signature,) = {table_signature(p) for p in k.parts}
        assert signature is not None
        assert len({p.reads[0].dtype for p in k.parts}) == 1
        assert len({int(p.loop_sizes[0]) % 16 == 0 for p in k.parts}) == 1
    (kt,) = [p for k in sched.kernels for p in kernel_parts(k) if t in p.writes]
    assert table_signature(kt) is None
    assert not any(kt in k.parts for k in tables)
    assert len(sched.kernels) == 5  # the four tables, and t's kernel with u's (not a table: one body each)
    assert not b.schedule(*ys, tgt=target(table_min_parts=0, max_parts=64, max_buffers=256)).kernels[0].table


def kernel_of(sched, value):
    (kernel,) = [k for k in sched.kernels if value in k.writes]
    return kernel


def test_a_part_past_max_elements_joins_its_body_s_table_but_no_capped_launch():
    """An update of more than `max_elements` elements written into its input (an optimizer's embedding)
    runs in its body's table launch, whose blocks all run one program; with no table of its body, or as a
    fresh result (autocast's copy of a weight), it keeps its own launch."""
    b = G()
    xs = [b.input(64) for _ in range(3)] + [b.input(4096)]
    ys = [b.axpb(x) for x in xs]
    small, large = ys[:3], ys[3]
    in_place = [(x, k) for k, x in enumerate(xs)]  # each new value written back into its input
    sched = b.schedule(*ys, mutations=in_place, tgt=target(max_elements=1024, table_min_parts=2))
    (table,) = sched.kernels
    assert table.table and any(large in p.writes for p in table.parts), [k.name for k in sched.kernels]
    capped = b.schedule(*ys, mutations=in_place, tgt=target(max_elements=1024, table_min_parts=0))
    (alone,) = [k for k in capped.kernels if large in k.writes]
    assert not isinstance(alone, ComboKernel) and len(capped.kernels) == 2, [k.name for k in capped.kernels]
    fresh = b.schedule(*small, large, tgt=target(max_elements=1024, table_min_parts=2))
    (alone,) = [k for k in fresh.kernels if large in k.writes]
    assert not isinstance(alone, ComboKernel) and len(fresh.kernels) == 2, [k.name for k in fresh.kernels]
    # Past int32 counts (the table's block numbers and element counts), a part keeps its own launch.
    huge = b.axpb(b.input(2**31))
    assert horizontal.eligible(kernel_of(b.schedule(huge), huge), HorizontalHeuristics(), table=False) is False
    assert horizontal.eligible(kernel_of(b.schedule(huge), huge), HorizontalHeuristics(), table=True) is False
    assert horizontal.eligible(kernel_of(b.schedule(large), large), HorizontalHeuristics(max_elements=1024), table=True)


def test_parts_of_other_constants_or_ops_are_other_bodies():
    b = G()
    xs = [b.input(32) for _ in range(4)]
    ys = [b.pw("add", b.pw("mul", xs[0], 0.5), 1.0), b.pw("add", b.pw("mul", xs[1], 0.5), 1.0)]
    ys += [b.pw("add", b.pw("mul", xs[2], 0.25), 1.0), b.pw("sub", b.pw("mul", xs[3], 0.5), 1.0)]
    sched = b.schedule(*ys, tgt=target(table_min_parts=2))
    signatures = [table_signature(p) for k in sched.kernels for p in kernel_parts(k)]
    assert len(set(signatures)) == 3
    (table,) = [k for k in combos(sched) if k.table]
    assert {v.id for v in table.writes} == {ys[0].id, ys[1].id}


def test_step_counters_of_one_element_take_one_table_launch():
    """An optimizer's per-parameter step counters (0-d, `step += 1`): kernels without a loop, one body."""
    b = G()
    counters = [b.input() for _ in range(40)]
    ys = [b.pw("add", c, 1.0) for c in counters]
    sched = b.schedule(*ys, tgt=target(table_min_parts=2))
    (table,) = sched.kernels
    assert table.table and len(table.parts) == 40
    assert table_signature(table.parts[0]) is not None and not table.parts[0].loop_sizes


def test_table_kernel_threads_take_16_bytes_of_the_narrowest_buffer_through_aligned_pointers():
    """A table kernel's launch gives each thread one 16-byte access of the narrowest buffer its body
    walks (8 bf16 elements beside an fp32 state; 4 where all are fp32), and its aligned form puts the
    16-byte hint on each walked pointer, where Triton reads it (on the integer before the cast, its
    loads and stores were one element wide); the form for any address has none."""
    b = G()
    ps = [b.input(4096, dtype=BF16) for _ in range(4)]
    ms = [b.input(4096) for _ in range(4)]
    xs = [b.input(4096) for _ in range(4)]
    bf16_updates = [b.pw("add", b.pw("mul", m, 0.9), p, dtype=F32) for p, m in zip(ps, ms)]
    fp32_updates = [b.axpb(x) for x in xs]
    sched = b.schedule(*bf16_updates, *fp32_updates, tgt=target(table_min_parts=2))
    tables = {BF16 if BF16 in {v.dtype for v in k.parts[0].reads} else F32: k for k in combos(sched) if k.table}
    assert set(tables) == {BF16, F32}, [(k.name, len(k.parts)) for k in combos(sched)]
    for dtype, elements in ((BF16, 8), (F32, 4)):
        r = render_triton_table(tables[dtype], TRITON)
        assert r.launch.xblock == 32 * r.launch.num_warps * elements, (dtype, r.launch)
        fast, any_ = r.source.split("\n\n\n")
        hinted = [ln for ln in fast.splitlines() if "tl.multiple_of(tl.load(row + " in ln]
        assert len(hinted) == sum(r.vector) and all(ln.endswith(", 16)") for ln in hinted), fast
        assert "multiple_of(tl.load(row" not in any_, any_
    plain = dataclasses.replace(TRITON.heuristics.horizontal, table_thread_bytes=0)
    tgt = dataclasses.replace(TRITON, heuristics=dataclasses.replace(TRITON.heuristics, horizontal=plain))
    r = render_triton_table(tables[BF16], tgt)
    assert r.launch.xblock == 32 * r.launch.num_warps * tgt.heuristics.launch.pointwise_thread_elements
