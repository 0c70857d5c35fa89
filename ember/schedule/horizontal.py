"""Horizontal fusion: independent small pointwise kernels run as one launch (a combo kernel).

An optimizer step's graph holds a small pointwise kernel per parameter (read p, g, m, v; write
p, m, v), each launched on its own: launches grow with the parameter count. This pass packs
kernels that no path of the schedule connects into `kernel.ComboKernel`s, as apex's
multi_tensor_apply and Inductor's combo kernels do; code generation walks the parts' blocks in
one launch (codegen/triton_combo.py, codegen/cpp_combo.py).

The rules (the target's `heuristics.horizontal`):
- a part is a pointwise kernel (no reduce dims, reductions or column sums), not a GEMM template,
  of static sizes, of at most `max_elements` elements (a table combo kernel's, below, also one that
  writes only mutated inputs' new values, an optimizer's update of a large parameter, below 2^31);
- parts are independent. Each step has a level: one more than the highest level of the steps it
  reads from. Extern calls also follow the previous extern call (their order stays, random
  number generators' included), and the kernel computing a mutated input's new value follows
  every other reader of the input (so it can still write in place). Kernels of one level have no
  path between them, in either direction, and packing kernels of one level never makes a cycle;
- at most `max_parts` parts and `max_buffers` distinct buffers per launch, except where at least
  `table_min_parts` kernels of one level share one body (`table_signature`: equal but for their
  buffers and element counts, as an optimizer's per-parameter updates are): those run as one launch
  of any size, each part's buffer addresses read from a table in memory (a table combo kernel);
- no part writes memory another part of its launch reads: the memory plan places each part's
  outputs knowing what the other parts read (memory.py);
- where the combined order raises the planned peak by more than `max_peak_increase`, the
  schedule keeps its kernels apart.

The steps are then ordered again, topologically, each combo kernel at its first part's place.
"""

from __future__ import annotations

import heapq

import torch

from ember import config
from ember.ir.graph import Value
from ember.ir.sizes import product
from ember.schedule import collectives
from ember.schedule.collectives import FusionBarriers
from ember.schedule.gemm import is_gemm_kernel
from ember.schedule.kernel import TABLE_MAX_ELEMENTS, ComboKernel, KConst, KConvert, Kernel, KLoad, KOp, walk
from ember.schedule.memory import plan_memory
from ember.schedule.state import ScheduleState
from ember.schedule.steps import ExternStep, FusionDecision, KernelStep, Step, step_inputs, step_outputs
from ember.target import HorizontalHeuristics


def combine_horizontally(state: ScheduleState, eager_peak: int | None) -> None:
    """Pack independent pointwise kernels of `state.steps` into combo kernels; replaces the steps
    and the memory plan (`state.memory`, planned for the steps as they were) when it does."""
    rules = state.target.heuristics.horizontal
    if rules.max_parts < 2:
        return
    steps = state.steps
    deps = dependencies(state, steps)
    barriers = collectives.fusion_barriers(state.graph) if config.get("overlap_collectives") else None
    updates = frozenset(state.graph.outputs[pos] for _, pos in state.graph.mutations)
    packed = pack(steps, levels(deps), rules, barriers, state.target.combo_rows, updates)
    if not packed:
        return
    groups = [g for g, _ in packed]
    combos = [
        ComboKernel(f"{state.kernel_prefix}combo{n}", [steps[k].kernel for k in g], table=table)
        for n, (g, table) in enumerate(packed)
    ]
    combined = reorder(steps, deps, groups, combos)
    memory = plan_memory(state.graph, combined, eager_peak)
    before, after = state.memory.peak_bytes, memory.peak_bytes
    if before is not None and after is not None and after > before + rules.max_peak_increase:
        reason = (
            f"horizontal: {sum(map(len, groups))} kernels in {len(groups)} launches would raise the planned "
            f"peak from {before / 1e6:.3g} to {after / 1e6:.3g} MB: each keeps its own launch"
        )
        state.decisions.append(FusionDecision("*", "*", False, reason))
        return
    state.steps, state.memory = combined, memory
    for combo in combos:
        parts = ", ".join(p.name for p in combo.parts)
        reason = f"horizontal: {len(combo.parts)} independent pointwise kernels in one launch"
        if combo.table:
            reason += " (one body, each part's buffers read from a table)"
        state.decisions.append(FusionDecision(combo.name, parts, True, reason))


def dependencies(state: ScheduleState, steps: list[Step]) -> list[set[int]]:
    """For each step, the earlier steps it must follow (see the module's docstring)."""
    produced_by: dict[Value, int] = {}
    readers: dict[Value, list[int]] = {}
    deps: list[set[int]] = []
    last_extern = None
    for k, step in enumerate(steps):
        inputs = step_inputs(step)
        need = {produced_by[v] for v in inputs if v in produced_by}
        if isinstance(step, ExternStep):
            need |= {last_extern} if last_extern is not None else set()
            last_extern = k
        deps.append(need)
        for v in inputs:
            readers.setdefault(v, []).append(k)
        for v in step_outputs(step):
            produced_by.setdefault(v, k)
    for inp, pos in state.graph.mutations:
        writer = produced_by.get(state.graph.outputs[pos])
        if writer is not None:
            deps[writer] |= {r for r in readers.get(inp, []) if r < writer}
    return deps


def levels(deps: list[set[int]]) -> list[int]:
    """Each step's level: 0 without dependencies, else one more than its dependencies' highest."""
    level: list[int] = []
    for need in deps:
        level.append(1 + max((level[d] for d in need), default=-1))
    return level


def eligible(kernel: object, rules: HorizontalHeuristics, rows: bool = True, table: bool = False) -> bool:
    """Whether a kernel may be a part of a combo kernel (`rows`: one that reads or writes at rows an index
    names, Target.combo_rows); `table`: of a table combo kernel, which takes parts past `max_elements`
    (below TABLE_MAX_ELEMENTS): the program a block of a large part runs is the one every block runs, so
    it costs the large part nothing (an optimizer's embedding update, at the copy bandwidth the other
    parameters get), and the part's buffers are then read through the table (under CUDA graphs: in place,
    not copied for each replay)."""
    if not isinstance(kernel, Kernel) or is_gemm_kernel(kernel) or kernel.writes_nothing or not kernel.stores:
        return False
    if any(kernel.loop_reduce) or kernel.reduces or kernel.column_partials or kernel.size_symbols():
        return False
    if not rows and kernel.checks_rows:
        return False
    numel = product(kernel.loop_sizes)
    if not numel.is_Integer or int(numel) <= 0:
        return False
    return int(numel) <= rules.max_elements or (table and int(numel) <= TABLE_MAX_ELEMENTS)


def pack(
    steps: list[Step],
    level: list[int],
    rules: HorizontalHeuristics,
    barriers: FusionBarriers | None = None,
    rows: bool = True,
    updates: frozenset = frozenset(),
) -> list[tuple[list[int], bool]]:
    """Groups of at least two step positions, each of eligible kernels of one level, in step
    order, and whether the group is a table combo kernel (its kernels share one body). Other
    groups keep within the caps on parts and buffers. With `barriers` (a graph's functional
    collectives), a kernel computing a collective's input keeps its own launch, and kernels
    after a wait share launches only with kernels after a wait. `rows`: Target.combo_rows.
    `updates`: the new values of the graph's mutated inputs; a kernel past `max_elements` joins a table
    only where it writes nothing else (an optimizer's update of a large parameter, in place): a large
    fresh result (autocast's bf16 copy of each weight) keeps its own launch, which frees what it reads
    and holds what it writes no earlier and no later than the schedule had it."""
    by_level: dict[tuple, list[int]] = {}
    capped_ok: set[int] = set()  # members of any combo kernel; the others, of a table only
    for k, step in enumerate(steps):
        if not isinstance(step, KernelStep):
            continue
        if eligible(step.kernel, rules, rows):
            capped_ok.add(k)
        elif not (
            rules.table_min_parts > 0
            and set(step.kernel.writes) <= updates
            and eligible(step.kernel, rules, rows, table=True)
        ):
            continue
        writes = step.kernel.writes
        if barriers is not None and barriers.feeds_start(writes):
            continue
        after = barriers is not None and barriers.after_wait_of(writes)
        by_level.setdefault((level[k], after), []).append(k)
    groups: list[tuple[list[int], bool]] = []
    for members in by_level.values():
        tables = _table_groups(steps, members, rules)
        groups += [(g, True) for g in tables]
        tabled = {k for g in tables for k in g}
        capped = [k for k in members if k not in tabled and k in capped_ok]
        groups += [(g, False) for g in _capped_groups(steps, capped, rules)]
    return sorted((g for g in groups if len(g[0]) >= 2), key=lambda g: g[0][0])


def _table_groups(steps: list[Step], members: list[int], rules: HorizontalHeuristics) -> list[list[int]]:
    """The members that at least `table_min_parts` (and two) kernels of one body make up, by body."""
    if rules.table_min_parts <= 0:
        return []
    by_body: dict[tuple, list[int]] = {}
    for k in members:
        body = table_signature(steps[k].kernel)
        if body is not None:
            by_body.setdefault(body, []).append(k)
    return [g for g in by_body.values() if len(g) >= max(2, rules.table_min_parts)]


def _capped_groups(steps: list[Step], members: list[int], rules: HorizontalHeuristics) -> list[list[int]]:
    """Consecutive members, within the caps on parts and distinct buffers per launch."""
    groups: list[list[int]] = []
    current: list[int] = []
    buffers: set[int] = set()
    for k in members:
        kernel = steps[k].kernel
        mine = {v.id for v in list(kernel.reads) + kernel.writes}
        if len(mine) > rules.max_buffers:
            continue
        if len(current) == rules.max_parts or len(buffers | mine) > rules.max_buffers:
            groups.append(current)
            current, buffers = [], set()
        current.append(k)
        buffers |= mine
    groups.append(current)
    return groups


def table_signature(kernel: Kernel) -> tuple | None:
    """What a kernel computes, but for which buffers it reads and writes and how many elements: two
    kernels of equal signatures run one body, given each one's buffers and count (a kernel of one
    element has no loop: an optimizer's step counter). None where the kernel's body depends on its
    sizes: a loop of more than one dim, an index other than the flat position or 0 (a 0-d input), a
    position the kernel computes (iota, an indexed store's row), a bool buffer. Whether the count is
    a multiple of 16 is part of it: the body tells Triton so (vector access)."""
    if len(kernel.loop_sizes) > 1 or kernel.column_partials or any(s.row is not None for s in kernel.stores):
        return None
    flat = kernel.index_vars[0] if kernel.loop_sizes else None  # none in a kernel of one element (a counter)
    params: dict[int, int] = {}  # buffer id -> its place among the kernel's parameters (codegen/render.py)
    for v in list(kernel.reads) + kernel.writes:
        params.setdefault(v.id, len(params))
    dtypes = tuple(v.dtype for v in {v.id: v for v in list(kernel.reads) + kernel.writes}.values())
    if torch.bool in dtypes:  # Triton keeps bools in memory as bytes: its pointer type is not the body's
        return None

    def place(expr) -> str | None:
        index = kernel.index(expr)
        return "x" if flat is not None and index == flat else "0" if index == 0 else None

    nodes = walk(kernel)
    at = {id(n): pos for pos, n in enumerate(nodes)}
    body: list[tuple] = []
    for n in nodes:
        if isinstance(n, KLoad):
            where = place(n.index)
            if where is None:
                return None
            body.append(("load", n.dtype, n.full, params[n.buffer.id], where))
        elif isinstance(n, KConst):
            body.append(("const", n.dtype, n.full, repr(n.value)))
        elif isinstance(n, KConvert):
            body.append(("convert", n.dtype, n.full, at[id(n.arg)]))
        elif isinstance(n, KOp):
            body.append(("op", n.dtype, n.full, n.fn, tuple(at[id(a)] for a in n.operands)))
        else:  # KIndex (a computed position), reductions
            return None
    stores = []
    for s in kernel.stores:
        where = place(s.index)
        if where is None:
            return None
        stores.append((params[s.buffer.id], where, at[id(s.value)], s.full))
    aligned = int(product(kernel.loop_sizes)) % 16 == 0
    return (len(kernel.reads), dtypes, tuple(body), tuple(stores), kernel.num_phases, aligned)


def reorder(steps: list[Step], deps: list[set[int]], groups: list[list[int]], combos: list[ComboKernel]) -> list[Step]:
    """The steps with each group as one combo kernel step, in a topological order that keeps the
    steps' own order where it can (each group at its first part's place)."""
    node = list(range(len(steps)))  # step position -> its node: a group's first position for its parts
    for g in groups:
        for k in g:
            node[k] = g[0]
    combo_at = {g[0]: KernelStep(c) for g, c in zip(groups, combos)}
    need: dict[int, set[int]] = {}
    for k, d in enumerate(deps):
        need.setdefault(node[k], set()).update(node[j] for j in d)
    for n, d in need.items():
        d.discard(n)
    users: dict[int, list[int]] = {}
    for n, d in need.items():
        for j in d:
            users.setdefault(j, []).append(n)
    waiting = {n: len(d) for n, d in need.items()}
    ready = [n for n, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: list[Step] = []
    while ready:
        n = heapq.heappop(ready)
        order.append(combo_at.get(n, steps[n]))
        for u in users.get(n, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(waiting):
        raise RuntimeError("horizontal fusion made a cycle among the steps")  # levels rule it out
    return order
