"""Render a combo kernel (schedule/kernel.py: ComboKernel) as Triton source.

Each part becomes a `@triton.jit` function of its own: the body codegen/triton.py renders for a
pointwise kernel, over a block number it is given. The combo kernel's programs are the parts'
blocks one after another (Inductor's sequential combo dispatch; apex's multi_tensor_apply walks a
table of tensors the same way): each program compares its id with the parts' first blocks and
calls its part. Parts being functions, each branch's names stay its own (a part's bf16 `tmp3`
and another's fp32 `tmp3` are never one variable of two types). Every part runs with the same
XBLOCK and warps, those launch_config gives its largest part; the launch's sizes are static.

A table combo kernel (ComboKernel.table: parts of one body, an optimizer's per-parameter updates)
is one body instead (`render_triton_table`), as apex's multi_tensor_apply is: each program reads its
part from a per-block table, the part's first block and element count from a table of heads, and its
buffer addresses from the part's row of an address table (backends/table_launch.py builds it from the
buffers of a call). Its source does not grow with the parts, no branch picks a part, and the launch
passes three pointers, not every buffer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy
import torch

from ember.codegen.render import Param, combo_params
from ember.codegen.triton import TRITON_DTYPE, TritonRenderer, jit_decorator
from ember.codegen.triton_launch import LaunchConfig, launch_config, pointwise_config
from ember.ir.sizes import product
from ember.schedule.kernel import TABLE_MAX_ELEMENTS, ComboKernel, KLoad
from ember.target import LaunchHeuristics, Target


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
    starts, blocks = block_starts([int(product(p.loop_sizes)) for p in kernel.parts], launch.xblock)
    lines = [
        jit_decorator(kernel.parts),
        f"def {kernel.name}({', '.join([p.name for p in params] + ['xnumel', 'XBLOCK: tl.constexpr'])}):",
    ]
    lines.append("    pid = tl.program_id(0)")
    for n, (r, name) in enumerate(zip(renderers, names)):
        test, block = part_dispatch(n, starts)
        call_args = ", ".join([p.name for p in r.params] + [block, "XBLOCK"])
        lines += [f"    {test}", f"        {name}({call_args})"]
    source = "\n\n\n".join(sources + ["\n".join(lines)])
    return TritonComboSource(kernel, source, params, launch, blocks)


def block_starts(sizes: list[int], block: int) -> tuple[list[int], int]:
    """Each part's first block in a launch whose programs are the parts' blocks of `block` elements one
    after another, and the launch's blocks."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // block)
    return starts, total


def part_dispatch(n: int, starts: list[int]) -> tuple[str, str]:
    """The branch a program takes to part `n` (its test on the program id) and the part's own block number."""
    last = n == len(starts) - 1
    test = "if True:" if len(starts) == 1 else "else:" if last else f"{'elif' if n else 'if'} pid < {starts[n + 1]}:"
    return test, "pid" if starts[n] == 0 else f"pid - {starts[n]}"


@dataclass
class TritonTableSource:
    """A table combo kernel's source and what its launch needs. `params`: every buffer of the parts
    once (codegen/render.py: combo_params), as the host passes them; `part_buffers`: per part, its
    buffers' places in `params`, in the body's parameter order (one row of the address table);
    `vector`: per body parameter, whether the body reads or writes it along the flat position (its
    address must be 16-byte aligned for `source`'s kernel, which tells Triton so; `name`_any assumes
    nothing); `first_blocks`, `numels` and `blocks`: the parts' first blocks and element counts, and the
    launch's blocks (the kernel reads them from two tables of int32s, made once: heads, a first block and a
    count per part, and each block's part)."""

    kernel: ComboKernel
    source: str
    params: list[Param]
    launch: LaunchConfig
    part_buffers: list[list[int]]
    vector: tuple[bool, ...]
    first_blocks: list[int]
    numels: list[int]
    blocks: int

    @property
    def heads(self) -> list[int]:
        return [v for first, numel in zip(self.first_blocks, self.numels) for v in (first, numel)]

    def part_of_block(self) -> torch.Tensor:
        """Each block's part, as int32s: made by torch, since a large part (an embedding) has a block for
        each `table_xblock` of its elements (a 262M-element one: half a million)."""
        ends = self.first_blocks[1:] + [self.blocks]
        counts = torch.tensor([end - first for first, end in zip(self.first_blocks, ends)], dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts)


class _TableBody(TritonRenderer):
    """The body every part of a table combo kernel shares, rendered from its first part."""

    def vector(self) -> tuple[bool, ...]:
        """Per parameter, whether the body reads or writes it along the flat position."""
        return tuple(self._along_position(p.value) for p in self.params)

    def render_table(self, name: str, aligned: bool, hint_numel: bool) -> tuple[str, tuple[bool, ...]]:
        vector = self.vector()
        self.emit(jit_decorator([self.kernel]))
        self.emit(f"def {name}(table, heads, part_of_block, XBLOCK: tl.constexpr):")
        self.indent += 1
        self.emit("pid = tl.program_id(0)")
        self.emit("part = tl.load(part_of_block + pid)")
        self.emit("xoffset = (pid - tl.load(heads + 2 * part)) * XBLOCK")
        numel = "tl.load(heads + 2 * part + 1)"
        self.emit(f"xnumel = {f'tl.multiple_of({numel}, 16)' if hint_numel else numel}")
        self.emit(f"row = table + part.to(tl.int64) * {len(self.params)}")
        for k, (p, along) in enumerate(zip(self.params, vector)):
            address = f"tl.load(row + {k}).to(tl.pointer_type({TRITON_DTYPE[p.value.dtype]}))"
            # The hint goes on the pointer: Triton does not carry an integer's divisibility through its
            # cast to a pointer, and without it every load and store is one element wide.
            self.emit(f"{p.name} = {f'tl.multiple_of({address}, 16)' if aligned and along else address}")
        self.emit("xindex = xoffset + tl.arange(0, XBLOCK)")
        self.emit("xmask = xindex < xnumel")
        self._emit_loop_vars(reduce=False)
        self.body()
        self.emit("return")
        return "\n".join(self.lines), vector

    def _along_position(self, buffer) -> bool:
        indices = [n.index for n in self.nodes if isinstance(n, KLoad) and n.buffer is buffer]
        indices += [s.index for s in self.kernel.stores if s.buffer is buffer]
        return any(self._varies(i) for i in indices)


def _thread_elements(walked: list[int], thread_bytes: int, rules: LaunchHeuristics) -> LaunchHeuristics:
    """The launch rules with each thread's elements set so that its access to the narrowest buffer
    the body walks (`walked`: their element sizes) spans `thread_bytes` (16: one vector access, 8 bf16
    elements or 4 fp32); 0, or no buffer walked, keeps the rules' own."""
    if not thread_bytes or not walked:
        return rules
    return dataclasses.replace(rules, pointwise_thread_elements=max(1, thread_bytes // min(walked)))


def render_triton_table(kernel: ComboKernel, target: Target) -> TritonTableSource:
    """One body for every part of a table combo kernel (schedule/horizontal.py: table_signature),
    two forms: `name` assumes 16-byte aligned addresses for its vector buffers, `name`_any none."""
    rules = target.heuristics.horizontal
    numels = [int(product(p.loop_sizes)) for p in kernel.parts]
    # Powers of two (Triton's blocks): the setting's, taken down, no larger than the largest part needs.
    xblock = min(1 << (max(1, rules.table_xblock).bit_length() - 1), 1 << (max(numels) - 1).bit_length())
    hint_numel = all(n % 16 == 0 for n in numels)
    first = kernel.parts[0]
    body = _TableBody(first, pointwise_config(xblock, target.heuristics.launch), target.interpreted)
    walked = [p.value.dtype.itemsize for p, along in zip(body.params, body.vector()) if along]
    launch = pointwise_config(xblock, _thread_elements(walked, rules.table_thread_bytes, target.heuristics.launch))
    fast, vector = _TableBody(first, launch, target.interpreted).render_table(kernel.name, True, hint_numel)
    any_, _ = _TableBody(first, launch, target.interpreted).render_table(f"{kernel.name}_any", False, hint_numel)
    params = combo_params(kernel.reads, kernel.writes)
    place = {p.value.id: k for k, p in enumerate(params)}
    part_buffers = []
    for part in kernel.parts:  # each part's buffers in the order the body names them (reads, then writes)
        body = combo_params(part.reads, part.writes)
        if part.size_symbols() or len(body) != len(vector):
            raise NotImplementedError("a table combo kernel's parts have one body, of static sizes")
        part_buffers.append([place[p.value.id] for p in body])
    starts, blocks = block_starts(numels, xblock)
    if blocks > TABLE_MAX_ELEMENTS or max(numels) > TABLE_MAX_ELEMENTS:
        raise NotImplementedError("a table combo kernel's blocks and counts are int32s")
    return TritonTableSource(
        kernel, fast + "\n\n\n" + any_, params, launch, part_buffers, vector, starts, numels, blocks
    )


# Writes an address table on the device from a launch's arguments (backends/table_launch.py: a table
# made while a CUDA graph captures, where a copy from the host cannot be captured): TABLE_FILL_ARGS
# addresses a launch, each passed plus TABLE_FILL_BIAS so that every one is an int64 to Triton (it
# types smaller integers int32), and not specialized on (one binary for every value).
TABLE_FILL_ARGS = 64
TABLE_FILL_BIAS = 1 << 62


def _table_fill_source() -> str:
    names = [f"a{k}" for k in range(TABLE_FILL_ARGS)]
    lines = [
        f"@triton.jit(do_not_specialize={list(range(1, TABLE_FILL_ARGS + 1))})",
        f"def ember_table_fill(out, {', '.join(names)}):",
    ]
    lines += [f"    tl.store(out + {k}, {a} - {TABLE_FILL_BIAS})" for k, a in enumerate(names)]
    return "\n".join(lines)


TABLE_FILL_SOURCE = _table_fill_source()
