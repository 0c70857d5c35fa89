"""The launch configurations the tuner measures for a Triton kernel: launch_config's choice first,
then its neighbours, each changing one of its numbers by a factor of two (a coordinate step, as
Inductor's coordinate-descent tuning takes), nearest first.

Which numbers vary, how far, and how many candidates there are at most are the target's data
(target.heuristics.tune); a candidate that would leave some of the target's SMs idle where the
heuristic's does not is pruned before anything is compiled. A candidate keeps what the kernel's form fixes: a row held whole keeps
its RBLOCK (the whole row) and a row kernel that also sums columns its rows per program (the
schedule sized its partial sums for them); blocks stay powers of two within the kernel's extent.
Measuring is the backend's (backends/launch_tuning.py).
"""

from __future__ import annotations

from dataclasses import replace

from ember.codegen.triton_launch import LaunchConfig, launch_config
from ember.ir.sizes import product
from ember.schedule.kernel import Kernel
from ember.target import Target


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _steps(value: int, steps: int) -> list[int]:
    """value * 2**k and value / 2**k for k = 1..steps, nearest first (halving first)."""
    out = []
    for k in range(1, steps + 1):
        out += [value >> k, value << k]
    return [v for v in out if v >= 1]


def launch_candidates(kernel: Kernel, target: Target, around: LaunchConfig | None = None) -> list[LaunchConfig]:
    """launch_config's choice (or `around`: a later round of tuning starts from the last one's
    winner), then up to target.heuristics.tune.max_candidates - 1 neighbours. A kernel of symbolic
    sizes gets only the heuristic's choice: there is no size to measure at."""
    base = around or launch_config(kernel, target)
    if not all(s.is_Integer for s in kernel.loop_sizes):
        return [base]
    h = target.heuristics.tune
    xnumel = int(product(s for s, r in zip(kernel.loop_sizes, kernel.loop_reduce) if not r))
    rnumel = int(product(s for s, r in zip(kernel.loop_sizes, kernel.loop_reduce) if r))
    moves: list[LaunchConfig] = []
    xcap = base.rows_per_program or _next_pow2(max(xnumel, 1))
    for x in _steps(base.xblock, h.block_steps):
        if x <= xcap and (not base.rows_per_program or base.rows_per_program % x == 0):
            moves.append(replace(base, xblock=x))
    if base.rblock and not base.persistent:  # a looped row: its step may change
        for r in _steps(base.rblock, h.block_steps):
            if r <= _next_pow2(rnumel) and r >= 16:
                moves.append(replace(base, rblock=r))
    for w in _steps(base.num_warps, h.warp_steps):
        if w <= h.max_warps:
            moves.append(replace(base, num_warps=w))
    if base.rblock and (not base.persistent or base.rows_per_program):  # a loop to pipeline
        for stages in range(2, h.max_loop_stages + 1):
            if stages != base.loop_stages:
                moves.append(replace(base, loop_stages=stages))
    # Pruned by a cost model's first rule before anything is compiled: a candidate with fewer
    # programs than the target has SMs (and than the heuristic's) leaves SMs idle.
    fill = min(_programs(base, xnumel), target.sm_count)
    out = [base]
    for c in moves:
        if c not in out and c.xblock * max(c.rblock, 1) <= h.max_block_elements and _programs(c, xnumel) >= fill:
            out.append(c)
    return out[: h.max_candidates]


def _programs(c: LaunchConfig, xnumel: int) -> int:
    return -(-xnumel // (c.rows_per_program or c.xblock))
