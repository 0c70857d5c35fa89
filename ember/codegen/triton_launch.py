"""Launch configurations of Triton kernels: block sizes, warps, programs per row or column and loop
stages, chosen from the kernel's sizes and the target's launch heuristics (`launch_config`). The
launch tuner (backends/launch_tuning.py) measures candidates around this choice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from ember.ir.sizes import product
from ember.schedule.cost import is_persistent
from ember.schedule.kernel import Kernel, KLoad, walk
from ember.target import LaunchHeuristics, Target


@dataclass
class LaunchConfig:
    xblock: int
    rblock: int  # 0 for pointwise kernels
    num_warps: int
    persistent: bool
    # Rows each program walks, XBLOCK at a time, when the kernel accumulates column sums
    # (kernel.KColumnPartial: one chunk of rows per program); 0: XBLOCK rows per program.
    rows_per_program: int = 0
    # Software-pipelining stages of the kernel's loop (a looped reduction's walk over RBLOCK
    # chunks, or a column-partial kernel's walk over its chunk of rows), as Triton's
    # `tl.range(num_stages=)`: the next step's loads are issued while this one computes.
    # 0: a plain loop.
    loop_stages: int = 0
    # A looped floating sum over more than RBLOCK * cascade_steps elements adds each lane's steps
    # in blocks of this many (target.heuristics.launch.cascade_steps); 0: never.
    cascade_steps: int = 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_config(kernel: Kernel, target: Target) -> LaunchConfig:
    """Block sizes from sizes alone (no autotuning), by the kernel's form: pointwise, a row kernel
    that also sums columns, a column sum, a row held whole, or a row walked in chunks. The numbers
    are the target's launch heuristics (ember/target.py: LaunchHeuristics)."""
    return replace(_launch_config(kernel, target), cascade_steps=target.heuristics.launch.cascade_steps)


def pointwise_config(xblock: int, h: LaunchHeuristics) -> LaunchConfig:
    """A pointwise kernel's launch at `xblock` (a power of two) elements a program: a warp per
    32 * pointwise_thread_elements of them, within pointwise_warps and pointwise_max_warps."""
    warps = _pow2_floor(max(1, xblock // (32 * h.pointwise_thread_elements)))
    return LaunchConfig(xblock, 0, max(h.pointwise_warps, min(h.pointwise_max_warps, warps)), False)


def _launch_config(kernel: Kernel, target: Target) -> LaunchConfig:
    h = target.heuristics.launch
    xnumel = product(s for s, r in zip(kernel.loop_sizes, kernel.loop_reduce) if not r)
    rnumel = product(s for s, r in zip(kernel.loop_sizes, kernel.loop_reduce) if r)
    xhint = int(xnumel) if xnumel.is_Integer else h.symbolic_outputs
    if not any(kernel.loop_reduce):
        return pointwise_config(min(h.pointwise_block, _next_pow2(max(xhint, 1))), h)
    if kernel.column_partials:  # the scheduler fused them only into rows held whole
        return _column_partials_config(kernel, int(rnumel), h)
    tiles = _tile_loads(kernel)
    if _reduces_across_rows(tiles):
        return _column_sum_config(kernel, tiles, xnumel, rnumel, target)
    if is_persistent(kernel):  # the cost model's rule: it counts one read of such rows
        rblock = _next_pow2(int(rnumel))
        # Several short rows per program, up to row_program_elements in flight, but enough
        # programs for row_programs_per_sm on every SM.
        rows = _next_pow2(max(1, xhint // (h.row_programs_per_sm * max(1, target.sm_count))))
        xblock = max(1, min(h.row_program_elements // rblock, rows))
        elems = xblock * rblock
        warps = max(h.row_min_warps, min(h.row_max_warps, elems // h.row_elements_per_warp))
        return LaunchConfig(
            xblock, rblock, h.row_all_warps if elems >= h.row_all_warps_from else _pow2_floor(warps), True
        )
    # A row too long to hold, walked in chunks by one program. An online softmax keeps two
    # accumulators per lane, so it walks smaller chunks with the same warps.
    online = any(r.kind == "sumexp" for r in kernel.reduces)
    chunk = h.looped_online_softmax_rblock if online else h.looped_row.rblock
    rblock = min(chunk, _next_pow2(int(rnumel))) if rnumel.is_Integer else chunk
    return LaunchConfig(h.looped_row.xblock, rblock, h.looped_row.warps, False)


def _column_partials_config(kernel: Kernel, rnumel: int, h: LaunchHeuristics) -> LaunchConfig:
    """A row kernel that also sums its rows' columns (kernel.KColumnPartial): one program per chunk
    of rows, walked XBLOCK rows a step (both powers of two), in software-pipelined stages: a step's
    loads are issued while the one before computes, which hides latency its few programs cannot."""
    rblock, rows = _next_pow2(rnumel), kernel.column_partials[0].rows
    xblock = max(1, min(h.column_partial_step_elements // rblock, rows))
    warps = max(h.row_min_warps, min(h.column_partial_max_warps, xblock * rblock // h.column_partial_elements_per_warp))
    return LaunchConfig(xblock, rblock, _pow2_floor(warps), True, rows, loop_stages=h.column_partial_stages)


def _column_sum_config(kernel: Kernel, tiles: list, xnumel, rnumel, target: Target) -> LaunchConfig:
    """A column sum (a bias or LayerNorm weight gradient, batch norm's statistics, a split's first
    stage): memory is contiguous along x, so a tile is XBLOCK columns by RBLOCK rows."""
    h = target.heuristics.launch
    xhint = int(xnumel) if xnumel.is_Integer else h.symbolic_outputs
    columns = _next_pow2(max(xhint, 1))
    short = rnumel.is_Integer and int(rnumel) <= h.short_columns_tile and xhint * int(rnumel) <= h.short_columns
    # A folded online softmax stays looped: held whole, it does not render.
    if short and is_persistent(kernel) and not any(r.kind == "sumexp" for r in kernel.reduces):
        # A split's second stage: each program holds its columns whole, so each sum is one load
        # and one reduce, not a walk of a few short steps.
        rblock = _next_pow2(int(rnumel))
        xblock = max(1, min(h.short_columns_xblock, h.short_columns_tile // rblock, columns))
        return LaunchConfig(xblock, rblock, h.short_columns_warps, True)
    steps = h.column_long_steps
    long_steps = LaunchConfig(min(steps.xblock, columns), steps.rblock, steps.warps, False)
    if len(tiles) < 2:
        # One input. A lone sum (a bias gradient) with columns for a program on every SM takes
        # small steps in many programs; several sums of it (batch norm's statistics), or fewer
        # columns, take long steps: fewer programs, each keeping more loads in flight.
        one = h.column_one_sum
        if len(kernel.reduces) == 1 and xhint >= one.xblock * target.sm_count:
            return LaunchConfig(one.xblock, one.rblock, one.warps, False)
        return long_steps
    if xnumel.is_Integer and xhint < h.few_columns:
        return long_steps  # few columns leave few programs: each takes long steps
    # Several inputs (x and the gradient): a load covers 128 bytes of a row where every input is
    # narrower than 4 bytes, unless a program walks a long chunk of rows.
    rhint = int(rnumel) if rnumel.is_Integer else h.symbolic_rows
    narrow = max(load.buffer.dtype.itemsize for load, _, _ in tiles) < 4 and rhint < h.column_long_chunk
    tile = h.column_several_inputs
    xblock = h.column_narrow_xblock if narrow else tile.xblock
    return LaunchConfig(min(xblock, columns), tile.rblock, tile.warps, False)


def _tile_loads(kernel: Kernel) -> list[tuple[KLoad, object, object]]:
    """The full-size loads that vary along both the innermost x and the innermost r loop
    variable, with their index's coefficients of each. Those decide a reduction's tiling: a load
    that varies along one only (a per-row statistic, a per-column weight) is one short vector
    per program whatever the tiling."""
    xs = [v for v, r in zip(kernel.index_vars, kernel.loop_reduce) if not r]
    rs = [v for v, r in zip(kernel.index_vars, kernel.loop_reduce) if r]
    if not xs or not rs:
        return []
    loads = []
    for node in walk(kernel):
        if isinstance(node, KLoad) and node.full:
            expr = sympy.expand(kernel.index(node.index))
            # Depending on a variable is not having a coefficient for it: a split over two dims
            # reads `3072 * (r % 1024)`, whose coefficient of r is 0.
            if {xs[-1], rs[-1]} <= expr.free_symbols:
                loads.append((node, expr.coeff(xs[-1]), expr.coeff(rs[-1])))
    return loads


def _reduces_across_rows(tiles: list[tuple[KLoad, object, object]]) -> bool:
    """Whether a reduction's tile loads (`_tile_loads`) are contiguous along x rather than along
    r: each votes by its index's coefficients. Loads along one variable only do not vote: with
    them, a LayerNorm weight gradient's per-row mean and rstd outvoted its two [rows, 768] inputs
    and the kernel read 16-byte pieces of each row (H100, gpt2_blocks training: 1200 GB/s)."""
    votes = 0
    for _, cx, cr in tiles:
        if cx == 1 and cr != 1:
            votes += 1
        elif cr == 1:
            votes -= 1
    return votes > 0


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)
