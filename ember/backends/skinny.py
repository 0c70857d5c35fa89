"""Grouped skinny products built and called: each `SkinnyProducts` extern of a schedule
(schedule/skinny.py) gets a `SkinnyKernel`, one Triton kernel over all the group's matrices
(codegen/skinny_triton.py) with the Target's tile (`heuristics.skinny`). The host program calls it as it
calls any extern: it allocates the products row-major and launches once. Groups of one spec (every layer
of a model) share one kernel, compiled once.
"""

from __future__ import annotations

import functools

import torch

from ember.backends.direct_launch import DirectLaunch, allocator, launch_fitting, load_triton
from ember.codegen.skinny_triton import KERNEL, SkinnyLaunch, first_blocks, render_skinny, tile
from ember.schedule.skinny import SkinnyProducts, SkinnySpec, split_arguments
from ember.schedule.steps import ExternStep, Schedule
from ember.target import Target


def build_skinny_kernels(sched: Schedule, target: Target) -> int:
    """Give each SkinnyProducts extern of `sched` its kernel where the code generator is Triton's;
    returns how many calls got one."""
    if target.name != "triton":
        return 0  # the extern's own ATen calls run
    built = 0
    for step in sched.steps:
        if isinstance(step, ExternStep) and isinstance(step.node.attrs["target"], SkinnyProducts):
            spec = step.node.attrs["target"].spec
            step.node.attrs["target"] = skinny_kernel(spec, skinny_launch(spec, target), target.interpreted)
            built += 1
    return built


def skinny_launch(spec: SkinnySpec, target: Target) -> SkinnyLaunch:
    """The Target's narrow tile, or its wide one where the narrow would run many programs per SM."""
    h = target.heuristics.skinny
    narrow = SkinnyLaunch(h.tile.xblock, h.tile.rblock, h.tile.warps, h.stages)
    _, programs = first_blocks(spec, tile(spec, narrow)[0])
    if target.sm_count and programs > h.wide_programs_per_sm * target.sm_count:
        return SkinnyLaunch(h.wide_tile.xblock, h.wide_tile.rblock, h.wide_tile.warps, h.wide_stages)
    return narrow


@functools.lru_cache(maxsize=64)
def skinny_kernel(spec: SkinnySpec, launch: SkinnyLaunch, interpreted: bool) -> SkinnyKernel:
    return SkinnyKernel(spec, launch, interpreted)


class SkinnyKernel:
    """A group of skinny products' kernel, called with the extern's arguments (the input, the matrices,
    the biases); returns the products."""

    fresh_result = True
    row_major_results = True

    def __init__(self, spec: SkinnySpec, launch: SkinnyLaunch, interpreted: bool):
        self.spec, self.launch = spec, launch
        self.__name__ = "skinny_products_kernel"  # the host program's name for it
        self.source = render_skinny(spec, launch, interpreted)
        self.fn = DirectLaunch(getattr(load_triton(self.source, "ember_skinny"), KERNEL), interpreted)
        _, self.programs = first_blocks(spec, tile(spec, launch)[0])

    def __call__(self, a: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        spec = self.spec
        matrices, biases = split_arguments(spec, rest)
        given = [b for b in biases if b is not None]
        empty = allocator(a.device)
        outs = [empty((spec.rows, n), (n, 1), spec.dtype) for n in spec.columns]
        tensors = (a, *matrices, *outs, *given)
        scalars = (*a.stride(), *[s for b in matrices for s in b.stride()], *[b.stride(-1) for b in given])
        self.launch = launch_fitting(self.fn, (self.programs,), tensors, scalars, {}, self.launch)
        return tuple(outs)


__all__ = ["SkinnyKernel", "build_skinny_kernels", "skinny_kernel", "skinny_launch"]
