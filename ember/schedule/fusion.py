"""From a graph to an ordered schedule of kernels, externs and aliases.

1. Realize: decide which values live in memory. Graph outputs, extern inputs and reduction
   results do; pointwise values and views do not (they are recomputed / re-indexed inside
   each kernel that reads them).
2. Group: one kernel per realized value, over its domain.
3. Fuse: merge a group into a producer or sibling whose domain it fits (a pointwise group over
   a reduction's full or row shape; reductions over the same rows), when the merged kernel can
   be built (see kernel.py) and the merge makes no cycle. Producers first, largest saved
   buffer first.
4. Store only what someone outside the kernel reads; order the steps topologically.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from ember import config
from ember.ir.graph import Graph, Node, Value, layout_of
from ember.ir.sizes import index_symbol, product
from ember.ir.views import VIEW_KINDS, strides_of
from ember.schedule.cost import KernelCost, is_persistent, kernel_cost, size_hint
from ember.schedule.gemm import GemmChooser, GemmGroups, build_gemm_kernel, plan_gemms
from ember.schedule.kernel import COLUMN_PARTIAL_MAX_ROW, Domain, Kernel, NotFusable
from ember.schedule.kernel_builder import build_kernel, column_partial_input
from ember.schedule.memory import eager_peak as eager_peak_bytes
from ember.schedule.memory import nbytes, plan_memory
from ember.schedule.online import fold_online_softmax
from ember.schedule.steps import (  # some re-exported: the schedule's types
    AliasStep,
    ExternStep,
    FusionDecision,
    KernelStep,
    Schedule,
    Step,
    step_outputs,
)


@dataclass
class Group:
    id: int
    domain: Domain
    roots: list[Value]
    first: int  # position of its first node in the graph, for stable ordering
    kernel: Kernel | None = None


def view_chain(value: Value) -> tuple[Value, list[Node]]:
    """The non-view root of a value and the view nodes from root to value."""
    chain = []
    while value.node.op == "view":
        chain.append(value.node)
        value = value.node.inputs[0]
    return value, list(reversed(chain))


def _alias_layout(value: Value, root: Value, root_stride) -> tuple | None:
    """Strides and offset of `value` as a strided view of root's buffer, if it is one."""
    _, chain = view_chain(value)
    static = all(e.is_Integer for e in tuple(root.shape) + tuple(root_stride))
    if static and all(e.is_Integer for node in chain for e in node.out.shape):
        return _static_alias_layout(chain, root, root_stride)

    def index_fn(index):
        for node in reversed(chain):
            base = node.inputs[0]
            index = VIEW_KINDS[node.attrs["kind"]].index(index, base.shape, node.out.shape, node.attrs)
        return index

    syms = [index_symbol(f"a{k}") for k in range(len(value.shape))]
    return strides_of(index_fn, value.shape, root_stride, syms)


_META_VIEWS = {
    "permute": lambda t, a: t.permute(a["dims"]),
    "expand": lambda t, a: t.expand([int(s) for s in a["shape"]]),
    "reshape": lambda t, a: t.view([int(s) for s in a["shape"]]),
    "slice": lambda t, a: torch.ops.aten.slice(t, a["dim"], int(a["start"]), int(a["end"]), int(a["step"])),
    "select": lambda t, a: t.select(a["dim"], int(a["index"])),
    "unsqueeze": lambda t, a: t.unsqueeze(a["dim"]),
    "squeeze": lambda t, a: t.squeeze(a["dims"]) if a["dims"] else t,
}


def _static_alias_layout(chain: list[Node], root: Value, root_stride) -> tuple | None:
    """The same question for static shapes, answered by torch's own view rules on a meta tensor
    (much faster than the symbolic route; `view` raises where a reshape would need a copy)."""
    t = torch.empty_strided([int(s) for s in root.shape], [int(s) for s in root_stride], device="meta")
    try:
        for node in chain:
            t = _META_VIEWS[node.attrs["kind"]](t, node.attrs)
    except RuntimeError:
        return None
    return tuple(sympy.Integer(s) for s in t.stride()), sympy.Integer(t.storage_offset())


class Scheduler:
    # Re-rank every group's pairs after each merge instead of only those near it (the tests
    # compare the two: the same merges must come out).
    rank_every_pair = False

    def __init__(
        self,
        graph: Graph,
        online_softmax: bool = False,
        gemm: GemmChooser | None = None,
        column_partials: bool = False,
        kernel_prefix: str = "k",
        no_siblings: frozenset = frozenset(),
    ):
        self.graph = graph
        # Groups computing any of these values take no sibling merges (they raised the peak).
        self.no_siblings = no_siblings
        self._sibling_pairs: set[frozenset] = set()  # candidate pairs that are siblings
        self.sibling_merged: set[int] = set()  # ids of groups a sibling merge made
        # Kernel names are `prefix` + group id: a training step's forward and backward graphs
        # name theirs apart ("fk3", "bk3"), so a profile's kernel names say which graph ran them.
        self.kernel_prefix = kernel_prefix
        # The target renders column sums accumulated by a row kernel (kernel.KColumnPartial).
        self.column_partials = column_partials
        self.gemm_chooser = gemm  # the backend's template-or-ATen choice (None: no GEMM template)
        self.gemm_plans: dict = {}  # id(extern node) -> GemmOp, for products run as the template
        self.gemms = GemmGroups()
        self.online_softmax = online_softmax  # the target renders schedule/online.py's sumexp
        self.position = {id(n): k for k, n in enumerate(graph.nodes)}
        self.aliases: dict[Value, AliasStep] = {}
        self._bytes_hint: dict[Value, int] = {}
        self.must_store: set[Value] = set()
        self.groups: dict[int, Group] = {}
        self.owner: dict[Value, int] = {}
        self.decisions: list[FusionDecision] = []
        self._deps: dict | None = None
        # Merges that failed, keyed by both groups' ids and sizes: a group that has not grown
        # since cannot merge now either, and retrying would rebuild the same kernel.
        self._failed: set[tuple] = set()
        # The merged domain of a pair, keyed like _failed: groups only grow, so (id, roots) is a state.
        self._domains: dict[tuple, Domain | None] = {}
        self._changed: set[Value] = set()  # set by the last merge (_absorbed)
        self._readers: dict[Value, set[int]] = {}
        self.read_outside_static: set[Value] = set()

    def kernel_name(self, gid: int) -> str:
        return f"{self.kernel_prefix}{gid}"

    def run(self, eager_peak: int | None, siblings: bool = True) -> Schedule:
        self._realize()
        self._group()
        if config.get("fuse"):
            self._fuse(siblings)
        steps = self._order()
        return Schedule(self.graph, steps, self.decisions, plan_memory(self.graph, steps, eager_peak))

    # 1. ---------------------------------------------------------------------------------
    def _realize(self) -> None:
        needed = [o for o in self.graph.outputs if isinstance(o, Value)]
        for node in self.graph.nodes:
            if node.op == "extern":
                needed += node.value_inputs()
        realized: list[Value] = []
        for v in needed:
            if v.node.op in ("input", "extern"):
                continue
            if v.node.op == "view":
                root, _ = view_chain(v)
                layout = _alias_layout(v, root, layout_of(root))
                if layout is not None:
                    self.aliases[v] = AliasStep(v, root, *layout)
                    if root.node.op not in ("input", "extern"):
                        realized.append(root)
                    continue
            realized.append(v)
        self.must_store = set(realized)
        # Read by an extern or kept as an alias's base: stored whatever fuses.
        self.read_outside_static = set(self.must_store) | {a.base for a in self.aliases.values()}
        for node in self.graph.nodes:
            if node.op == "extern":
                self.read_outside_static |= {view_chain(v)[0] if v in self.aliases else v for v in node.value_inputs()}
        for node in self.graph.nodes:
            if node.op == "reduce":
                realized.append(node.out)
        realized += self._plan_gemms()
        realized += self._shared_pointwise(set(realized))
        for v in dict.fromkeys(realized):
            self._new_group(v)

    def _plan_gemms(self) -> list[Value]:
        """Matrix products run by the GEMM template (schedule/gemm.py): each is a group of its own,
        whose kernel computes the product; pointwise consumers may then fuse into it."""
        operand_strides = lambda v: self.aliases[v].stride if v in self.aliases else layout_of(v)
        self.gemm_plans, notes = plan_gemms(self.graph.nodes, self.gemm_chooser, operand_strides, self.graph.device)
        for what, chosen, why in notes:
            self.decisions.append(FusionDecision(what, "GEMM template" if chosen else "ATen", chosen, why))
        outs = [p.out for p in self.gemm_plans.values()]
        # A product the graph returns or an extern reads is stored whatever fuses into it.
        read = {o for o in self.graph.outputs if isinstance(o, Value)}
        read |= {v for node in self.graph.nodes if self._is_extern(node) for v in node.value_inputs()}
        self.read_outside_static |= read & set(outs)
        return outs

    def _is_extern(self, node: Node) -> bool:
        return node.op == "extern" and id(node) not in self.gemm_plans

    def _shared_pointwise(self, realized: set[Value]) -> list[Value]:
        """Pointwise values worth computing once: read by several consumers, and built from
        several buffers whose bytes outweigh the value's (`worth_storing`). Inlining those into
        every consumer would re-read all their inputs each time (a residual stream inlined into
        each layer's norm grows with depth).
        A realized value costs nothing when its consumers fuse with it: it is stored only if
        a kernel outside its own reads it.
        """
        users: dict[Value, int] = {}
        for node in self.graph.nodes:
            if node.op == "view":
                continue  # not a reader: its own readers are counted at the root
            for v in node.value_inputs():
                root, _ = view_chain(v)
                users[root] = users.get(root, 0) + 1
        reads: dict[Value, frozenset] = {}
        chosen: list[Value] = []
        for node in self.graph.nodes:
            if node.op in ("full", "iota"):
                # Computed from the loop position alone: no buffer to re-read (nll_loss's
                # where(t != ignore_index, t, 0) reads only t).
                reads[node.out] = frozenset()
                continue
            if node.op not in ("pointwise", "cast"):
                continue
            v = node.out
            touched: set = set()
            for x in node.value_inputs():
                root, _ = view_chain(x)
                touched |= reads.get(root, {root})
            # Buffers much smaller than v (batch norm's per-channel mean under x - mean) are re-read
            # from cache by each consumer: only buffers of about v's size make inlining costly.
            large = [b for b in touched if 8 * size_hint(product(b.shape)) >= size_hint(product(v.shape))]
            if v in realized or worth_storing(users.get(v, 0), [b.dtype.itemsize for b in large], v.dtype.itemsize):
                if v not in realized:
                    chosen.append(v)
                reads[v] = frozenset({v})
            else:
                reads[v] = frozenset(touched)
        return chosen

    # 2. ---------------------------------------------------------------------------------
    def _new_group(self, v: Value) -> None:
        if v.node.op == "reduce":
            domain = Domain(v.node.inputs[0].shape, tuple(v.node.attrs["dims"]))
        else:
            domain = Domain(v.shape)
        gid = len(self.groups)
        self.groups[gid] = Group(gid, domain, [v], self.position[id(v.node)])
        self.owner[v] = gid
        if id(v.node) in self.gemm_plans:
            self.gemms.by_group[gid] = self.gemm_plans[id(v.node)]

    def _group(self) -> None:
        for g in self.groups.values():
            g.kernel = self._build(g.domain, g.id, g.roots)

    def _build(self, domain: Domain, gid: int, roots: list[Value], stored: list[Value] | None = None) -> Kernel:
        if gid in self.gemms.by_group:
            stored = list(roots) if stored is None else stored
            return build_gemm_kernel(
                self.kernel_name(gid), domain, gid, roots, stored, self.owner, self.gemms.by_group[gid]
            )
        stored = list(roots) if stored is None else stored
        kernel = build_kernel(self.kernel_name(gid), domain, gid, roots, stored, self.owner, self.column_partials)
        if self.online_softmax:
            fold_online_softmax(kernel)
        return kernel

    # 3. ---------------------------------------------------------------------------------
    def _producers(self, g: Group) -> set[int]:
        """Groups whose buffers g loads directly."""
        return {self.owner[v] for v in g.kernel.reads if v in self.owner}

    def _needs(self, values) -> set:
        """The steps computing `values`: ("g", group id) or ("e", extern node id)."""
        out = set()
        for v in values:
            if v not in self.owner:
                v = view_chain(v)[0]
            if v in self.owner:
                out.add(("g", self.owner[v]))
            elif v.node.op == "extern":
                out.add(("e", id(v.node)))
        return out

    def _step_deps(self) -> dict:
        """The dependency graph over steps: ("g", group id) and ("e", extern node id) -> what it needs."""
        deps: dict = {("g", gid): self._needs(g.kernel.reads) for gid, g in self.groups.items()}
        for node in self.graph.nodes:
            if node.op == "extern":
                deps[("e", id(node))] = self._needs(node.value_inputs())
        return deps

    def _reaches(self, src: int, dst: int, skip_direct: bool) -> bool:
        """Whether dst depends on src through a path of at least one other step."""
        if self._deps is None:  # built once; _absorbed keeps it current
            self._deps = self._step_deps()
        deps = self._deps
        stack = [d for d in deps[("g", dst)] if not (skip_direct and d == ("g", src))]
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

    def _merged_domain(self, a: Group, b: Group) -> Domain | None:
        key = (a.id, len(a.roots), b.id, len(b.roots))
        if key not in self._domains:
            self._domains[key] = self._merged_domain_of(a, b)
        return self._domains[key]

    def _merged_domain_of(self, a: Group, b: Group) -> Domain | None:
        if a.id in self.gemms.by_group or b.id in self.gemms.by_group:
            return self.gemms.merged_domain(a, b)
        if a.domain == b.domain:
            return a.domain
        if self.column_partials:
            for rows, sums in ((a, b), (b, a)):
                if all(column_partial_input(v, rows.domain) is not None for v in sums.roots):
                    return rows.domain  # the row kernel accumulates the column sums
        red, pw = (a, b) if a.domain.reduce_dims else (b, a)
        if not red.domain.reduce_dims or pw.domain.reduce_dims:
            return None
        if all(red.domain.index_for(v.shape) is not None for v in pw.roots):
            return red.domain
        return None

    def _fuse(self, siblings: bool = True) -> None:
        """Best first: merge the candidate pair that saves the most bytes, until none saves any."""
        self._readers = self._reader_map()  # kept current by _merge
        # Each group's candidate pairs, ranked, kept between merges: a merge changes the pairs of
        # the groups near it only (_near_merge), and recomputing every group's after every merge
        # made scheduling quadratic in the graph's size.
        pairs: dict[int, list[tuple]] = {}
        stale = set(self.groups)
        while True:
            for bid in stale:
                b = self.groups.get(bid)
                if b is None:
                    pairs.pop(bid, None)
                    continue
                pairs[bid] = [
                    (-self._estimate_saving(a, b), min(a.first, b.first), a.id, b.id)
                    for a in self._candidates(b, siblings)
                ]
            for _, _, aid, bid in sorted(p for ranked in pairs.values() for p in ranked):
                if self._try_merge(self.groups[aid], self.groups[bid]):
                    # the survivor (aid or bid) stays marked when it later absorbs another group
                    if frozenset((aid, bid)) in self._sibling_pairs or {aid, bid} & self.sibling_merged:
                        self.sibling_merged |= {aid, bid}
                    if self.rank_every_pair:
                        pairs.clear()
                        stale = set(self.groups)
                    else:
                        stale = self._near_merge({aid, bid})
                    break
            else:
                return

    def _near_merge(self, merged: set[int]) -> set[int]:
        """The groups whose candidate pairs or their savings the last merge may have changed.

        A pair (a, b) depends on both groups, on who reads and who owns the values they read or
        compute, and on groups at most two steps from b (a producer's other readers, a
        consumer's other producers). The merge changed one group, removed another, and changed
        the readers or owner of `_changed` values only: every group touching those is
        affected, and so is every group within two steps of one of them."""
        near = {gid for gid in merged if gid in self.groups}
        for v in self._changed:
            near |= self._readers.get(v, set())
            if v in self.owner and self.owner[v] in self.groups:
                near.add(self.owner[v])
        frontier = set(near)
        for _ in range(2):
            reached: set[int] = set()
            for gid in frontier:
                g = self.groups[gid]
                for v in list(g.kernel.reads) + list(g.roots):
                    reached |= self._readers.get(v, set())
                    if v in self.owner:
                        reached.add(self.owner[v])
            frontier = {gid for gid in reached if gid in self.groups} - near
            near |= frontier
        return near | (merged - set(self.groups))

    def _reader_map(self) -> dict[Value, set[int]]:
        readers: dict[Value, set[int]] = {}
        for g in self.groups.values():
            for v in g.kernel.reads:
                readers.setdefault(v, set()).add(g.id)
        return readers

    def _candidates(self, b: Group, siblings: bool) -> list[Group]:
        """Groups b could merge into: its producers, and siblings over a domain both fit that read a
        buffer b reads (the q/k/v slices of one projection, the mean and variance of one row) or
        another output of b's producer, or feed a kernel b feeds (the stages of split reductions: a
        cross-entropy's mean and its index check; merged, one launch instead of two)."""
        out = [self.groups[p] for p in sorted(self._producers(b)) if p != b.id and p in self.groups]
        if siblings:
            producers = {g.id for g in out}
            near = {gid for v in b.kernel.reads for gid in self._readers.get(v, ())}
            near |= {gid for p in out for v in p.roots for gid in self._readers.get(v, ())}
            consumers = {gid for v in b.roots for gid in self._readers.get(v, ())} - {b.id}
            near |= {pid for c in consumers if c in self.groups for pid in self._producers(self.groups[c])}
            # (A consumer of b that reads b's inputs too is not a sibling: it merges as a consumer.)
            for gid in sorted(near - producers - consumers - {b.id}):
                g = self.groups[gid]
                if {g.id, b.id} & set(self.gemms.by_group):
                    continue  # a GEMM template takes epilogues only, never siblings
                if self.no_siblings and not self.no_siblings.isdisjoint(g.roots + b.roots):
                    continue
                if g.id < b.id and self._merged_domain(g, b) is not None:  # each unordered pair once
                    out.append(g)
                    self._sibling_pairs.add(frozenset((g.id, b.id)))
        return out

    def sibling_merged_groups(self) -> list[Group]:
        return [g for gid, g in self.groups.items() if gid in self.sibling_merged]

    def moved_earlier(self, v: Value, g: Group) -> bool:
        """Whether group g computes v before v's own place in the graph."""
        return self.position.get(id(v.node), g.first) > g.first

    def _needed_outside(self, v: Value, members: set[int]) -> bool:
        """Whether a kernel made of `members` must store v: someone outside reads it."""
        return v in self.read_outside_static or bool(self._readers.get(v, set()) - members)

    def _group_cost(self, g: Group, members: set[int]) -> KernelCost:
        stored = {v for v in g.roots if self._needed_outside(v, members)}
        return kernel_cost(g.kernel, stored=stored)

    def _estimate_saving(self, a: Group, b: Group) -> int:
        """Bytes a merge saves, from buffer sizes alone (ranks candidates before building any)."""
        members = {a.id, b.id}
        saved = 0
        for prod, cons in ((a, b), (b, a)):
            for v in prod.roots:
                if v in cons.kernel.reads:  # no longer loaded; no longer stored if only cons read it
                    saved += self._hint_bytes(v) * (1 if self._needed_outside(v, members) else 2)
        for v in set(a.kernel.reads) & set(b.kernel.reads):
            saved += self._hint_bytes(v)  # read once, not twice
        return saved

    def _hint_bytes(self, v: Value) -> int:
        """size_hint(nbytes(v)), kept: every candidate pair is ranked again after each merge, and the
        sympy arithmetic made a graph of ~200 kernels take minutes to schedule (OpInfo bicubic)."""
        n = self._bytes_hint.get(v)
        if n is None:
            n = self._bytes_hint[v] = size_hint(nbytes(v))
        return n

    def _try_merge(self, a: Group, b: Group) -> bool:
        attempt = (a.id, len(a.roots), b.id, len(b.roots))
        if attempt in self._failed:
            return False
        if not self._merge(a, b):
            self._failed.add(attempt)
            return False
        return True

    def _absorbed(self, first: Group, second: Group, old_reads: list) -> None:
        """Bring the reader map and the step dependencies up to date after `first` absorbed
        `second` (old_reads: both groups' reads before). Only their entries change: the other
        groups read the same values, and what `second` owned `first` now owns. Rebuilding both
        after every merge took most of a ResNet-50 schedule's time."""
        for v in old_reads:
            readers = self._readers.get(v)
            if readers is not None:
                readers -= {first.id, second.id}
        for v in first.kernel.reads:
            self._readers.setdefault(v, set()).add(first.id)
        # Values whose readers or owner changed (second's now belong to first), and the values
        # of the changed groups themselves.
        self._changed = set(old_reads) | set(first.kernel.reads) | set(first.roots)
        if self._deps is None:
            return
        gone, now = ("g", second.id), ("g", first.id)
        del self._deps[gone]
        for needs in self._deps.values():
            if gone in needs:
                needs.discard(gone)
                needs.add(now)
        self._deps[now] = self._needs(first.kernel.reads)

    def _merge(self, a: Group, b: Group) -> bool:
        names = (self.kernel_name(b.id), self.kernel_name(a.id))
        refusal = self.gemms.merge_refusal(a, b)
        if refusal is not None:
            self._decide(names, False, refusal)
            return False
        domain = self._merged_domain(a, b)
        if domain is None:
            self._decide(names, False, f"domains differ: {a.domain} vs {b.domain}")
            return False
        if self._reaches(a.id, b.id, skip_direct=True) or self._reaches(b.id, a.id, skip_direct=True):
            self._decide(names, False, "would form a cycle (a path between them runs through another step)")
            return False
        first, second = (a, b) if a.first <= b.first else (b, a)
        if second.id in self.gemms.by_group:
            first, second = second, first  # the merged group stays the template's
        roots = first.roots + second.roots
        saved_owner = dict(self.owner)
        for v in second.roots:
            self.owner[v] = first.id
        try:
            kernel = self._build(domain, first.id, roots)
            buffers = len(set(kernel.reads) | set(kernel.writes))
            if buffers > config.get("max_kernel_buffers"):
                raise NotFusable(f"too many buffers: {buffers} > max_kernel_buffers={config.get('max_kernel_buffers')}")
            if kernel.column_partials:
                _check_column_partials(kernel)
        except NotFusable as e:
            self.owner = saved_owner
            self._decide(names, False, str(e))
            return False
        members = {a.id, b.id}
        before_bytes = size_hint(self._group_cost(a, {a.id}).bytes + self._group_cost(b, {b.id}).bytes)
        merged = Group(first.id, domain, roots, first.first, kernel)
        after_bytes = size_hint(self._group_cost(merged, members).bytes)
        if after_bytes > before_bytes:
            self.owner = saved_owner
            self._decide(
                names, False, f"would move more bytes ({before_bytes / 1e6:.3g} MB -> {after_bytes / 1e6:.3g} MB)"
            )
            return False
        old_reads = list(first.kernel.reads) + list(second.kernel.reads)
        first.roots, first.domain, first.kernel = roots, domain, kernel
        del self.groups[second.id]
        self._absorbed(first, second, old_reads)
        # Equal bytes still saves a launch (disjoint slices of one buffer, read side by side).
        why = (
            f"merged over {domain}"
            if after_bytes < before_bytes
            else f"merged over {domain}: same bytes, one launch fewer"
        )
        if first.id in self.gemms.by_group:
            why = f"epilogue fused into the GEMM template: {' + '.join(kernel.origins)}"
        elif kernel.column_partials:
            sums = ", ".join(f"%{c.buffer.name}" for c in kernel.column_partials)
            why = f"merged over {domain}: the row kernel also sums its rows' columns ({sums}), reading them once"
        self._decide(names, True, why, before_bytes - after_bytes)
        return True

    def _decide(self, names, accepted, reason, saved=None) -> None:
        decision = FusionDecision(names[0], names[1], accepted, reason, saved)
        if accepted or decision not in self.decisions:  # a refusal retried after other merges: once
            self.decisions.append(decision)

    # 4. ---------------------------------------------------------------------------------
    def _order(self) -> list[Step]:
        # Which group values does anyone outside their own group read?
        self._readers = self._reader_map()

        items: list[tuple[int, Step, set]] = []  # (position, step, the values it needs)
        for g in self.groups.values():
            stored = [v for v in g.roots if self._needed_outside(v, {g.id})]
            g.kernel = self._build(g.domain, g.id, g.roots, stored)
            # A template reads its operands as tensors: an aliased operand needs its base's producer.
            needs = {self.aliases[v].base if v in self.aliases else v for v in g.kernel.reads}
            items.append((g.first, KernelStep(g.kernel), needs))
        for node in self.graph.nodes:
            if self._is_extern(node):
                needs = {self.aliases[v].base if v in self.aliases else v for v in node.value_inputs()}
                items.append((self.position[id(node)], ExternStep(node), needs))
        produced_by: dict[Value, int] = {}
        for k, (_, step, _) in enumerate(items):
            for v in step_outputs(step):
                produced_by[v] = k
        # Topological order, ties broken by graph position (Kahn's algorithm).
        deps = [{produced_by[v] for v in needs if v in produced_by} - {k} for k, (_, _, needs) in enumerate(items)]
        done: set[int] = set()
        order: list[Step] = []
        while len(done) < len(items):
            ready = [k for k in range(len(items)) if k not in done and deps[k] <= done]
            if not ready:
                stuck = [
                    (_describe(items[k][1]), sorted(_describe(items[d][1]) for d in deps[k] - done))
                    for k in range(len(items))
                    if k not in done
                ]
                raise RuntimeError(f"schedule has a cycle among {stuck}")
            k = min(ready, key=lambda k: items[k][0])
            done.add(k)
            order.append(items[k][1])
            order.extend(self._aliases_after(items[k][1]))
        order[:0] = [a for a in self.aliases.values() if a.base.node.op == "input"]
        return order

    def _aliases_after(self, step: Step) -> list[AliasStep]:
        outs = set(step_outputs(step))
        return [a for a in self.aliases.values() if a.base in outs]


def worth_storing(readers: int, large_itemsizes: list[int], itemsize: int) -> bool:
    """Whether a pointwise value read by `readers` kernels is cheaper stored once than recomputed
    in each, counting bytes per element: recomputing re-reads its large inputs in every reader;
    storing reads them once, writes the value, and each reader but the one that fuses with it
    (usually one does) reads it back. Ties store (a residual stream, x + a in bf16).

    Batch norm's backward `where(relu_mask, 0, grad)` (1 + 2 bytes in, 2 out) is recomputed by
    its two readers: after a split neither fuses with it, and storing it cost a write and two
    reads of the gradient's size per layer. Two large inputs at least: one input is never worth a
    buffer of its own."""
    if readers < 2 or len(large_itemsizes) < 2:
        return False
    return (readers - 1) * sum(large_itemsizes) >= readers * itemsize


def _check_column_partials(kernel: Kernel) -> None:
    if not any(kernel.loop_reduce):  # rows of one element: merge_dims left no reduce loop to render
        raise NotFusable("column sums need a row loop (every reduce dim has size 1)")
    rnumel = product(s for s, r in zip(kernel.loop_sizes, kernel.loop_reduce) if r)
    if not is_persistent(kernel) or not rnumel.is_Integer or int(rnumel) > COLUMN_PARTIAL_MAX_ROW:
        raise NotFusable(
            f"column sums need the whole row in registers (rows of {rnumel}, at most {COLUMN_PARTIAL_MAX_ROW})"
        )


def _describe(step: Step) -> str:
    if isinstance(step, KernelStep):
        return step.kernel.name
    if isinstance(step, ExternStep):
        return f"extern {step.node.origin} -> {[v.name for v in step.node.outputs]}"
    return f"alias {step.value.name}"


# Scratch a schedule may hold beyond eager's peak without counting as raising it: split
# reductions keep small partial results (eager has none), a few KB per reduction.
PEAK_SLACK_BYTES = 1 << 20
# Reschedules refusing the sibling merges live at the peak, before refusing them all.
PEAK_RETRIES = 3


def schedule(
    graph: Graph,
    eager_peak: int | None = None,
    online_softmax: bool = False,
    gemm: GemmChooser | None = None,
    column_partials: bool = False,
    kernel_prefix: str = "k",
) -> Schedule:
    """Schedule the graph. If sibling merges would raise the planned peak above eager's
    (`eager_peak`: of the graph as imported, before any pass; default: of `graph`), undo them:
    a sibling merged early keeps its output alive longer. `online_softmax`: fold a long row's
    max and sum of exp into one pass (schedule/online.py), for targets that render it. `gemm`:
    the backend's choice between its GEMM template and ATen per matrix product (schedule/gemm.py).
    `column_partials`: let row kernels accumulate split column sums (kernel.KColumnPartial), for
    targets that render them. `kernel_prefix` starts every kernel's name."""
    if eager_peak is None:
        eager_peak = eager_peak_bytes(graph)
    scheduler = Scheduler(graph, online_softmax, gemm, column_partials, kernel_prefix)
    sched = scheduler.run(eager_peak)
    plan = sched.memory
    limit = None if plan.eager_peak_bytes is None else plan.eager_peak_bytes * 1.01 + PEAK_SLACK_BYTES

    def over(plan) -> bool:
        return plan.peak_bytes is not None and limit is not None and plan.peak_bytes > limit

    def self_bytes(v: Value) -> int:
        return size_hint(nbytes(v))

    # First refuse only the sibling merges whose kernels touch memory live at the peak (ResNet-50's
    # backward: one such merge raised the peak 103 MB over eager's, and refusing every sibling
    # merge split each batch norm's two gradient sums into two passes over the gradient).
    refused: set[Value] = set()
    notes: list[FusionDecision] = []
    for _ in range(PEAK_RETRIES):
        if not over(sched.memory):
            break
        # A sibling merge runs the later sibling's work at the earlier one's place, so its values
        # are held longer. The largest such values live at the peak, until they cover the excess:
        # their groups take no siblings in the next schedule.
        live = sched.memory.peak_live
        held = {
            v: g
            for g in scheduler.sibling_merged_groups()
            for v in g.roots
            if v in live and v not in refused and scheduler.moved_earlier(v, g)
        }
        if not held:
            break
        excess, chosen = sched.memory.peak_bytes - limit, []
        for v in sorted(held, key=lambda v: (-self_bytes(v), v.id)):
            chosen.append(v)
            excess -= self_bytes(v)
            if excess <= 0:
                break
        was = sched.memory.peak_bytes
        names = ", ".join(dict.fromkeys(scheduler.kernel_name(held[v].id) for v in chosen))
        refused |= set(chosen)
        retry_scheduler = Scheduler(graph, online_softmax, gemm, column_partials, kernel_prefix, frozenset(refused))
        retry = retry_scheduler.run(eager_peak)
        if retry.memory.peak_bytes >= was:
            continue  # no lower: keep the best schedule so far; the next retry refuses other values
        scheduler, sched = retry_scheduler, retry
        notes.append(
            FusionDecision(
                "*", names, False,
                f"sibling merges refused: live at the peak, they raised it to {was / 1e6:.3g} MB "
                f"(eager {plan.eager_peak_bytes / 1e6:.3g} MB; without them {sched.memory.peak_bytes / 1e6:.3g} MB)",
            )
        )  # fmt: skip
    sched.decisions.extend(notes)
    plan = sched.memory
    if over(plan):
        alone = Scheduler(graph, online_softmax, gemm, column_partials, kernel_prefix).run(eager_peak, siblings=False)
        if alone.memory.peak_bytes < plan.peak_bytes:
            alone.decisions.append(
                FusionDecision(
                    "*", "*", False,
                    f"sibling merges refused: they would raise peak memory to {plan.peak_bytes / 1e6:.3g} MB "
                    f"(eager {plan.eager_peak_bytes / 1e6:.3g} MB; without them {alone.memory.peak_bytes / 1e6:.3g} MB)",
                )
            )  # fmt: skip
            return alone
    return sched
