"""Render a combo kernel (schedule/kernel.py: ComboKernel) as Triton source.

Each part becomes a `@triton.jit` function of its own: the body codegen/triton.py renders for a
pointwise kernel, over a block number it is given. The combo kernel's programs are the parts'
blocks one after another (Inductor's sequential combo dispatch; apex's multi_tensor_apply walks a
table of tensors the same way): each program compares its id with the parts' first blocks and
calls its part. Parts being functions, each branch's names stay its own (a part's bf16 `tmp3`
and another's fp32 `tmp3` are never one variable of two types). Every part runs with the same
XBLOCK and warps, those launch_config gives its largest part; the launch's sizes are static.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ember.codegen.render import Param, combo_params
from ember.codegen.triton import TritonRenderer, jit_decorator
from ember.codegen.triton_launch import LaunchConfig, launch_config
from ember.ir.sizes import product
from ember.schedule.kernel import ComboKernel, Kernel
from ember.target import Target


@dataclass
class TritonComboSource:
    """What the backend launches, as codegen/triton.py's TritonKernelSource: every buffer of the
    parts once, `xnumel` (the blocks times XBLOCK, so the grid is the blocks), XBLOCK and warps."""

    kernel: ComboKernel
    source: str
    params: list[Param]
    launch: LaunchConfig
    blocks: int

    @property
    def xnumel(self) -> sympy.Integer:
        return sympy.Integer(self.blocks * self.launch.xblock)

    @property
    def rnumel(self) -> sympy.Integer:
        return sympy.Integer(1)


class _PartRenderer(TritonRenderer):
    """A pointwise kernel as a function of the block it computes (its own program id's place)."""

    def render_part(self, name: str) -> str:
        numel = int(product(self.kernel.loop_sizes))
        args = [p.name for p in self.params] + ["pid", "XBLOCK: tl.constexpr"]
        self.emit("@triton.jit")
        self.emit(f"def {name}({', '.join(args)}):")
        self.indent += 1
        self.emit(f"xoffset = {'pid.to(tl.int64)' if self.wide_index else 'pid'} * XBLOCK")
        self.emit("xindex = xoffset + tl.arange(0, XBLOCK)")
        self.emit(f"xmask = xindex < {numel}")
        self._emit_loop_vars(reduce=False)
        self.body()
        self.emit("return")
        return "\n".join(self.lines)


def render_triton_combo(kernel: ComboKernel, target: Target) -> TritonComboSource:
    launches = [launch_config(p, target) for p in kernel.parts]
    launch = max(launches, key=lambda c: (c.xblock, c.num_warps))
    if any(c.rblock or c.rows_per_program for c in launches):
        raise NotImplementedError("a combo kernel's parts are pointwise")
    renderers = [_PartRenderer(p, launch, target.interpreted) for p in kernel.parts]
    names = [f"{kernel.name}_p{n}" for n in range(len(kernel.parts))]
    sources = [r.render_part(name) for r, name in zip(renderers, names)]
    params = combo_params(kernel.reads, kernel.writes)
    starts, blocks = _block_starts(kernel.parts, launch.xblock)
    lines = [
        jit_decorator(kernel.parts),
        f"def {kernel.name}({', '.join([p.name for p in params] + ['xnumel', 'XBLOCK: tl.constexpr'])}):",
    ]
    lines.append("    pid = tl.program_id(0)")
    for n, (r, name, start) in enumerate(zip(renderers, names, starts)):
        last = n == len(names) - 1
        test = "if True:" if len(names) == 1 else "else:" if last else f"{'elif' if n else 'if'} pid < {starts[n + 1]}:"
        block = "pid" if start == 0 else f"pid - {start}"
        call_args = ", ".join([p.name for p in r.params] + [block, "XBLOCK"])
        lines += [f"    {test}", f"        {name}({call_args})"]
    source = "\n\n\n".join(sources + ["\n".join(lines)])
    return TritonComboSource(kernel, source, params, launch, blocks)


def _block_starts(parts: list[Kernel], xblock: int) -> tuple[list[int], int]:
    """Each part's first block in the launch, and the launch's blocks."""
    starts, total = [], 0
    for p in parts:
        starts.append(total)
        total += -(-int(product(p.loop_sizes)) // xblock)
    return starts, total
