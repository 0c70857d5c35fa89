"""One merge of two groups into one kernel: whether it is legal, and whether it pays.

A merge is refused, with its reason in the fusion log, when

- the domains do not fit: two groups merge over one domain, a pointwise group over a reduction's
  full or row shape, reductions over the same rows, column sums into the row kernel that reads
  their input (when the target renders them), epilogues into a GEMM template (gemm.GemmGroups);
- it would form a cycle: a path between the two runs through another step;
- the merged kernel cannot be built (kernel_builder.NotFusable), or has too many buffers;
- it would move more bytes than the two kernels apart.

`fusion.py` ranks the candidate pairs and asks for merges, best first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from ember import config
from ember.ir.graph import Value
from ember.ir.ops import POINTWISE
from ember.ir.sizes import product
from ember.schedule.cost import KernelCost, is_persistent, kernel_cost, size_hint
from ember.schedule.groups import group_kernel
from ember.schedule.kernel import Domain, Kernel, KLoad, KOp, NotFusable, walk
from ember.schedule.kernel_builder import column_partial_input
from ember.schedule.realize import view_chain
from ember.schedule.state import Group, ScheduleState
from ember.schedule.steps import FusionDecision


@dataclass
class FusionMemo:
    """What one fusion pass keeps between merge attempts; it ends with the pass. Groups only
    grow, so a group's (id, number of roots) names one state of it."""

    # Attempts that failed, by both groups' states: retrying would rebuild the same kernel.
    failed: set[tuple] = field(default_factory=set)
    # The merged domain of a pair, by both groups' states.
    domains: dict[tuple, Domain | None] = field(default_factory=dict)
    # The steps each step needs: ("g", group id) or ("e", extern node id). Built at the first
    # cycle check, then kept current by each merge (rebuilding it after every merge took most of
    # a ResNet-50 schedule's time).
    deps: dict | None = None
    # Candidate pairs that are siblings, not producer and consumer.
    sibling_pairs: set[frozenset] = field(default_factory=set)
    # Merges kept apart around functional collectives (collectives.FusionBarriers), None without any.
    barriers: object = None
    # size_hint(nbytes(v)): every candidate pair is ranked again after each merge, and the sympy
    # arithmetic made a graph of ~200 kernels take minutes to schedule (OpInfo bicubic).
    bytes_hint: dict[Value, int] = field(default_factory=dict)


def merged_domain(state: ScheduleState, memo: FusionMemo, a: Group, b: Group) -> Domain | None:
    """The domain a kernel of both groups iterates over, or None where they do not fit one."""
    key = (a.id, len(a.roots), b.id, len(b.roots))
    if key not in memo.domains:
        memo.domains[key] = _merged_domain(state, a, b)
    return memo.domains[key]


def _merged_domain(state: ScheduleState, a: Group, b: Group) -> Domain | None:
    if a.id in state.gemms.by_group or b.id in state.gemms.by_group:
        if any(v in state.indexed_stores for v in a.roots + b.roots):
            return None  # the template stores at its own domain's positions only
        return state.gemms.merged_domain(a, b)
    if a.domain == b.domain:
        return a.domain
    if state.target.column_partials:
        for rows, sums in ((a, b), (b, a)):
            if all(column_partial_input(v, rows.domain) is not None for v in sums.roots):
                return rows.domain  # the row kernel accumulates the column sums
    red, pw = (a, b) if a.domain.reduce_dims else (b, a)
    if not red.domain.reduce_dims or pw.domain.reduce_dims:
        return None
    if all(red.domain.index_for(v.shape) is not None for v in pw.roots):
        return red.domain
    return None


def try_merge(state: ScheduleState, memo: FusionMemo, a: Group, b: Group) -> set[Value] | None:
    """Merge b and a if legal and not costlier. Returns the values whose readers or owner the
    merge changed (with the merged group's own), or None where it was refused."""
    attempt = (a.id, len(a.roots), b.id, len(b.roots))
    if attempt in memo.failed:
        return None
    changed = _merge(state, memo, a, b)
    if changed is None:
        memo.failed.add(attempt)
    return changed


def _merge(state: ScheduleState, memo: FusionMemo, a: Group, b: Group) -> set[Value] | None:
    names = (state.kernel_name(b.id), state.kernel_name(a.id))
    refusal = state.gemms.merge_refusal(a, b)
    domain = None
    if refusal is None:
        domain = merged_domain(state, memo, a, b)
        if domain is None:
            refusal = f"domains differ: {a.domain} vs {b.domain}"
    if refusal is None and (_reaches(state, memo, a.id, b.id) or _reaches(state, memo, b.id, a.id)):
        refusal = "would form a cycle (a path between them runs through another step)"
    if refusal is not None:
        _decide(state, names, False, refusal)
        return None
    first, second = (a, b) if a.first <= b.first else (b, a)
    if second.id in state.gemms.by_group:
        first, second = second, first  # the merged group stays the template's
    roots = first.roots + second.roots
    saved_owner = dict(state.owner)
    for v in second.roots:
        state.owner[v] = first.id
    try:
        kernel = _merged_kernel(state, domain, first.id, roots)
    except NotFusable as e:
        state.owner = saved_owner
        _decide(state, names, False, str(e))
        return None
    members = {a.id, b.id}
    if _costly_work_into_strided_reduction(state, a, b, kernel):
        state.owner = saved_owner
        why = "costly pointwise work into a reduction whose loop walks memory across strides"
        _decide(state, names, False, why)
        return None
    before_bytes = size_hint(_group_cost(state, a, {a.id}).bytes + _group_cost(state, b, {b.id}).bytes)
    merged = Group(first.id, domain, roots, first.first, kernel)
    after_bytes = size_hint(_group_cost(state, merged, members).bytes)
    if after_bytes > before_bytes:
        state.owner = saved_owner
        why = f"would move more bytes ({before_bytes / 1e6:.3g} MB -> {after_bytes / 1e6:.3g} MB)"
        _decide(state, names, False, why)
        return None
    old_reads = list(first.kernel.reads) + list(second.kernel.reads)
    first.roots, first.domain, first.kernel = roots, domain, kernel
    del state.groups[second.id]
    changed = _absorbed(state, memo, first, second, old_reads)
    why = _why_merged(state, first, domain, before_bytes, after_bytes)
    _decide(state, names, True, why, before_bytes - after_bytes)
    return changed


def _costly_work_into_strided_reduction(state: ScheduleState, a: Group, b: Group, kernel: Kernel) -> bool:
    """Whether the merge puts a pointwise group of costly work per element (`realize.costly_min_flops`: the
    C++ target's) into a reduction whose innermost loop reads memory across strides (a squeeze-and-excite's
    mean over a channels-last image's positions). That loop does not vectorize: EfficientNet-B0's depthwise
    convolutions and SiLUs computed in their means' loops took 0.5-4.3 ms each on 2 cores, where a pointwise
    kernel computes them along the channels and the mean reads the result."""
    least = state.target.heuristics.realize.costly_min_flops
    reduce_vars = [v for v, r in zip(kernel.index_vars, kernel.loop_reduce) if r]
    if not least or not reduce_vars:
        return False
    if not any(_float_flops(g.kernel) >= least for g in (a, b) if not any(g.kernel.loop_reduce)):
        return False
    inner = reduce_vars[-1]
    for load in (n for n in walk(kernel) if isinstance(n, KLoad)):
        index = _unclamped_along(kernel.index(load.index), inner)
        if inner in index.free_symbols and sympy.expand(index.subs(inner, inner + 1) - index) != 1:
            return True
    return False


def _unclamped_along(index, var):
    """index without a padded view's clamps (Min/Max) of a position along `var`, which only keep the read
    inside the buffer: they leave its step along `var` as it is."""
    return index.replace(
        lambda e: isinstance(e, (sympy.Min, sympy.Max)) and var in e.free_symbols,
        lambda e: next(arg for arg in e.args if var in arg.free_symbols),
    )


def _float_flops(kernel: Kernel) -> int:
    """Floating-point work per element of a pointwise kernel (integer position arithmetic left out)."""
    return sum(POINTWISE[n.fn].flops for n in walk(kernel) if isinstance(n, KOp) and n.dtype.is_floating_point)


def _merged_kernel(state: ScheduleState, domain: Domain, gid: int, roots: list[Value]) -> Kernel:
    kernel = group_kernel(state, domain, gid, roots)
    buffers = len(set(kernel.reads) | set(kernel.writes))
    if buffers > config.get("max_kernel_buffers"):
        raise NotFusable(f"too many buffers: {buffers} > max_kernel_buffers={config.get('max_kernel_buffers')}")
    if kernel.column_partials:
        _check_column_partials(kernel, state.target.heuristics.launch.column_partial_max_row)
    return kernel


def _why_merged(state: ScheduleState, merged: Group, domain: Domain, before_bytes: int, after_bytes: int) -> str:
    kernel = merged.kernel
    if merged.id in state.gemms.by_group:
        return f"epilogue fused into the GEMM template: {' + '.join(kernel.origins)}"
    if kernel.column_partials:
        sums = ", ".join(f"%{c.buffer.name}" for c in kernel.column_partials)
        return f"merged over {domain}: the row kernel also sums its rows' columns ({sums}), reading them once"
    # Equal bytes still saves a launch (disjoint slices of one buffer, read side by side).
    if after_bytes < before_bytes:
        return f"merged over {domain}"
    return f"merged over {domain}: same bytes, one launch fewer"


def _decide(state: ScheduleState, names: tuple[str, str], accepted: bool, reason: str, saved=None) -> None:
    decision = FusionDecision(names[0], names[1], accepted, reason, saved)
    if accepted or decision not in state.decisions:  # a refusal retried after other merges: once
        state.decisions.append(decision)


def _group_cost(state: ScheduleState, g: Group, members: set[int]) -> KernelCost:
    stored = {v for v in g.roots if state.needed_outside(v, members)}
    return kernel_cost(g.kernel, stored=stored)


def _check_column_partials(kernel: Kernel, max_row: int) -> None:
    if not any(kernel.loop_reduce):  # rows of one element: merge_dims left no reduce loop to render
        raise NotFusable("column sums need a row loop (every reduce dim has size 1)")
    rnumel = product(s for s, r in zip(kernel.loop_sizes, kernel.loop_reduce) if r)
    if not is_persistent(kernel) or not rnumel.is_Integer or int(rnumel) > max_row:
        raise NotFusable(f"column sums need the whole row in registers (rows of {rnumel}, at most {max_row})")


# -- the steps' dependencies, for the cycle check ---------------------------------------------


def _needs(state: ScheduleState, values) -> set:
    """The steps computing `values`: ("g", group id) or ("e", extern node id)."""
    out = set()
    for v in values:
        if v not in state.owner:
            v = view_chain(v)[0]
        if v in state.owner:
            out.add(("g", state.owner[v]))
        elif v.node.op == "extern":
            out.add(("e", id(v.node)))
    return out


def _step_deps(state: ScheduleState) -> dict:
    deps: dict = {("g", gid): _needs(state, g.kernel.reads) for gid, g in state.groups.items()}
    for node in state.graph.nodes:
        if node.op == "extern":
            deps[("e", id(node))] = _needs(state, node.value_inputs())
    return deps


def _reaches(state: ScheduleState, memo: FusionMemo, src: int, dst: int) -> bool:
    """Whether group dst depends on group src through a path of at least one other step."""
    if memo.deps is None:
        memo.deps = _step_deps(state)
    deps = memo.deps
    stack = [d for d in deps[("g", dst)] if d != ("g", src)]
    seen: set = set()
    while stack:
        cur = stack.pop()
        if cur == ("g", src):
            return True
        if cur in seen:
            continue
        seen.add(cur)
        stack.extend(deps.get(cur, ()))
    return False


def _absorbed(state: ScheduleState, memo: FusionMemo, first: Group, second: Group, old_reads: list) -> set[Value]:
    """Bring the reader map and the step dependencies up to date after `first` absorbed `second`
    (old_reads: both groups' reads before). Only their entries change: the other groups read the
    same values, and what `second` owned `first` now owns. Returns the values whose readers or
    owner changed, and those of the merged group itself."""
    for v in old_reads:
        readers = state.readers.get(v)
        if readers is not None:
            readers -= {first.id, second.id}
    for v in first.kernel.reads:
        state.readers.setdefault(v, set()).add(first.id)
    if memo.deps is not None:
        gone, now = ("g", second.id), ("g", first.id)
        del memo.deps[gone]
        for needs in memo.deps.values():
            if gone in needs:
                needs.discard(gone)
                needs.add(now)
        memo.deps[now] = _needs(state, first.kernel.reads)
    return set(old_reads) | set(first.kernel.reads) | set(first.roots)
