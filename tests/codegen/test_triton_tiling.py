"""How the Triton backend tiles reductions: column sums (memory contiguous along the kept dim)
are tiled across rows, whatever the kernel's other loads and however the split indexes its rows;
rows contiguous along the reduced dim stay persistent."""

from __future__ import annotations

import dataclasses

import sympy
import torch

from ember.backends.cpp import CppBackend
from ember.codegen.triton import render_triton
from ember.codegen.triton_launch import launch_config
from ember.schedule.split import split_reductions
from tests.schedule.test_fusion import TRITON, G

BF16 = torch.bfloat16
# The Triton backend's target (TRITON, through its CPU interpreter: an H100's SM count) without
# row kernels that accumulate column sums.
NO_ROW_PROGRAMS = dataclasses.replace(TRITON, row_programs=0)
FEW_COLUMNS = TRITON.heuristics.launch.few_columns


def _cast(b: G, x, dtype=torch.float32):
    return b.g.add("cast", [x], {"dtype": dtype}, [(x.shape, dtype, None)], origin="_to_copy").out


def _split_and_schedule(b: G, out, target=NO_ROW_PROGRAMS):
    """Split as the pipeline does for the Triton backend's target."""
    b.g.outputs = [out]
    assert split_reductions(b.g, target) == 1
    return b.schedule(*b.g.outputs).kernels


def _big_reader(sched_kernels, big):
    (k,) = [k for k in sched_kernels if big in k.reads]
    return k


def test_layer_norm_weight_gradient_is_tiled_across_rows():
    # sum over rows of (x - mean) * rstd * grad: the row statistics vary along the rows only and
    # must not outvote the two [rows, 768] inputs.
    b = G()
    x, grad = b.input(8192, 768, dtype=BF16), b.input(8192, 768, dtype=BF16)
    mean, rstd = b.input(8192, 1), b.input(8192, 1)
    xf, gf = _cast(b, x), _cast(b, grad)
    dw = b.reduce("sum", b.pw("mul", b.pw("mul", b.pw("sub", xf, mean), rstd), gf), (0,))
    k = _big_reader(_split_and_schedule(b, dw), x)
    cfg = launch_config(k, TRITON)
    assert not cfg.persistent and (cfg.xblock, cfg.rblock, cfg.num_warps) == (64, 32, 4)  # 128-byte bf16 rows


def test_bias_gradient_split_across_two_dims_is_tiled_across_rows():
    # [16, 1024, 3072] summed over (0, 1): the split chunk spans the two dims, so its row index is
    # `r % 1024`, which has no coefficient of r; it still varies along r.
    b = G()
    g = b.input(16, 1024, 3072, dtype=BF16)
    db = b.reduce("sum", _cast(b, g), (0, 1))
    kernels = _split_and_schedule(b, db)
    cfg = launch_config(_big_reader(kernels, g), TRITON)
    # One tile input: 64 columns by 8 rows a step, many small programs in flight.
    assert not cfg.persistent and (cfg.xblock, cfg.rblock, cfg.num_warps) == (64, 8, 4)
    # The second stage sums a few partial rows into 3072 outputs: each program holds 32 columns
    # whole (persistent, all rows in one step), so 96 programs, not 48 of 64 columns.
    (second,) = [k for k in kernels if g not in k.reads]
    rows = int(next(s for s, r in zip(second.loop_sizes, second.loop_reduce) if r))
    cfg = launch_config(second, TRITON)
    assert cfg.persistent and cfg.xblock == 32 and cfg.rblock >= rows, (rows, cfg)


def test_batch_norm_sums_take_long_steps():
    # Batch norm's sums over a channels-last [64, C, H, W] activation split by image: one program
    # per 32 channels of one image. Several inputs with fewer than FEW_COLUMNS partial columns: a
    # step covers 128 rows (8 warps). A lone sum of x with many columns is tiled as a bias gradient.
    def sums(c, hw, grads: bool, target=TRITON):
        b = G()
        shape = tuple(sympy.Integer(v) for v in (64, c, hw, hw))
        channels_last = tuple(sympy.Integer(v) for v in (hw * hw * c, 1, hw * c, c))
        x = b.g.add_input(shape, BF16, channels_last)
        xf = _cast(b, x)
        if grads:
            g = b.g.add_input(shape, BF16, channels_last)
            xf = b.pw("mul", xf, _cast(b, g))
        kernels = _split_and_schedule(b, b.reduce("sum", xf, (0, 2, 3)), target)
        cfg = launch_config(_big_reader(kernels, x), target)
        return not cfg.persistent, (cfg.xblock, cfg.rblock, cfg.num_warps)

    assert sums(256, 56, grads=False) == (True, (64, 8, 4))  # 64 chunks of 3136 rows
    assert sums(64, 112, grads=True) == (True, (32, 128, 8))  # 64 x 64 partial columns
    # With H split in 8 as well (split.py: _rewrite_two_dims, off by default): 512 x 64 partial
    # columns of 1568 rows, tiled as other many-column sums.
    second_split = TRITON.tuned("split.max_second_split=8")
    assert sums(64, 112, grads=True, target=second_split) == (True, (32, 32, 4))
    assert sums(128, 28, grads=True, target=second_split) == (
        True,
        (32, 128, 8),
    )  # 64 x 128: one program per SM or more
    assert 256 * 64 >= FEW_COLUMNS and sums(256, 56, grads=True) == (True, (32, 32, 4))
    # ResNet-50's last stage: 7 x 7 x 64 = 3136 rows per channel split although under MIN_REDUCE,
    # as a column reduction on a target with row programs.
    assert sums(2048, 7, grads=True)[0]
    # There, the statistics (a sum and the variance's two shifted sums, one pass over x) take long
    # steps too, where a lone sum of as many columns (a bias gradient) takes 64 x 8.
    b = G()
    shape = tuple(sympy.Integer(v) for v in (64, 2048, 7, 7))
    x = b.g.add_input(shape, BF16, tuple(sympy.Integer(v) for v in (49 * 2048, 1, 7 * 2048, 2048)))
    xf = _cast(b, x)
    mean = b.pw("truediv", b.reduce("sum", xf, (0, 2, 3), keepdim=True), 3136)
    diff = b.pw("sub", xf, mean)
    var = b.reduce("sum", b.pw("mul", diff, diff), (0, 2, 3), keepdim=True)
    b.g.outputs = [mean, var]
    assert split_reductions(b.g, TRITON) == 2  # the mean's, then the variance's
    # (The final combination, over [r8, 2048], also reads x: each chunk's first element.)
    (stats,) = [k for k in b.schedule(*b.g.outputs).kernels if x in k.reads and "r7" in str(k.domain)]
    assert len(stats.reduces) == 3
    cfg = launch_config(stats, TRITON)
    assert (cfg.xblock, cfg.rblock, cfg.num_warps) == (32, 128, 8)


def test_target_partials_sizes_the_chunks_of_a_column_sum():
    # The Triton backend asks for 131072 partial results: a bias gradient over 16384 rows of 768
    # is summed in 64 chunks of 256 rows (the C++ backend, 32768, gives 32 chunks of 512).
    for target, chunks in ((CppBackend().target(), 32), (TRITON, 64)):
        b = G()
        g = b.input(16384, 768, dtype=BF16)
        b.g.outputs = [b.reduce("sum", _cast(b, g), (0,))]
        assert split_reductions(b.g, target) == 1
        shapes = [tuple(int(d) for d in n.out.shape) for n in b.g.nodes if n.op == "reduce"]
        assert (chunks, 768) in shapes, shapes


def test_row_reduction_stays_persistent():
    b = G()
    x, w = b.input(4096, 768), b.input(768)
    y = b.pw("mul", b.pw("sub", x, b.reduce("max", x, (1,), keepdim=True)), w)
    (k,) = b.schedule(y).kernels
    cfg = launch_config(k, TRITON)
    assert cfg.persistent and cfg.rblock == 1024


def test_short_column_softmax_stays_looped():
    # A softmax down 20001 rows of 8 columns once failed to render: under SHORT_COLUMNS, but the
    # scheduler had folded its max and sum of exp into one online pass for a looped kernel, and
    # held whole that does not render. One row past the split's min_reduce (an odd length, as
    # 20001) takes the same path today: the max and the sum of exp each split in two stages, the
    # first with a masked tail, each stage a short column. With the split taken from 1024 elements on,
    # in chunks of 64 at least (the Target's heuristics), the same path from 1025 rows, not 20001:
    # compared with eager through the Triton interpreter, whose cost grows with the rows.
    import ember
    from tests.helpers import assert_close, ember_compile, reports

    rows = 1025
    with reports() as report, ember.config.override(heuristics="split.min_reduce=1024,split.min_chunk=64"):
        got = ember_compile(lambda t: torch.softmax(t, 0), "triton")(x := torch.randn(rows, 8))
    domains = [(k.ops, k.domain) for k in report.graphs[0].kernels]
    assert (["amax"], "[16, r65, 8]") in domains and (["amax"], "[r16, 8]") in domains, domains
    assert_close(
        got,
        torch.softmax(x, 0),
        rtol=1e-5,
        atol=1e-6,
        what="softmax over dim 0",
        line=f"repro: softmax(x, 0), x [{rows}, 8]",
    )


def test_the_launch_follows_the_targets_sm_count():
    # A lone column sum over 4096 columns: with a program of 64 columns on every SM (4096 >= 64 x
    # 16) it takes small steps in many programs; on an H100's 132 SMs that would leave SMs idle, so
    # it takes long steps down the rows.
    b = G()
    (k,) = b.schedule(b.reduce("sum", b.input(512, 4096), (0,))).kernels
    cfg, small = launch_config(k, TRITON), launch_config(k, dataclasses.replace(TRITON, sm_count=16))
    assert (cfg.xblock, cfg.rblock, cfg.num_warps) == (32, 128, 8)
    assert (small.xblock, small.rblock, small.num_warps) == (64, 8, 4)
    # Rows held whole: several rows per program, but programs enough for two on every SM.
    b = G()
    (k,) = b.schedule(b.reduce("max", b.input(4096, 1024), (1,))).kernels
    assert launch_config(k, TRITON).xblock == 4  # 4096 rows over 264 programs: 16, capped at 4096 elements
    assert launch_config(k, dataclasses.replace(TRITON, sm_count=1024)).xblock == 2


def test_the_target_says_whether_the_interpreter_runs_the_kernel():
    # Triton's interpreter truncates fp32 -> bf16: only there does a cast round by hand.
    b = G()
    b.g.outputs = [_cast(b, b.input(64, 64), BF16)]
    (k,) = b.schedule(*b.g.outputs).kernels
    assert TRITON.interpreted and "ember_round_bf16" in render_triton(k, TRITON).source
    assert "ember_round_bf16" not in render_triton(k, dataclasses.replace(TRITON, interpreted=False)).source


def test_pointwise_programs_take_four_elements_a_thread():
    # XBLOCK 1024 runs on 8 warps, 512 on 4, and small blocks keep the 2-warp floor.
    for numel, block, warps in ((1 << 20, 1024, 8), (512, 512, 4), (256, 256, 2), (40, 64, 2)):
        b = G()
        x = b.input(numel, dtype=BF16)
        (k,) = b.schedule(b.pw("mul", _cast(b, x), _cast(b, x))).kernels
        cfg = launch_config(k, TRITON)
        assert (cfg.xblock, cfg.rblock, cfg.num_warps) == (block, 0, warps), numel
    # Blocks past 1024 (a target allowing them) keep pointwise_max_warps.
    wide = dataclasses.replace(TRITON, heuristics=TRITON.heuristics.tuned("launch.pointwise_block=4096"))
    assert (launch_config(k, wide).xblock, launch_config(k, wide).num_warps) == (64, 2)
    b = G()
    x = b.input(1 << 20, dtype=BF16)
    (k,) = b.schedule(b.pw("mul", _cast(b, x), _cast(b, x))).kernels
    assert (launch_config(k, wide).xblock, launch_config(k, wide).num_warps) == (4096, 8)
