"""Fusion: merge groups into fewer kernels, the pair that saves the most bytes first.

Each group's candidates are its producers (a consumer fuses into the kernel that computes
what it reads) and its siblings: groups over a domain both fit that read a buffer it reads
(the q/k/v slices of one projection, the mean and variance of one row), read another output of
its producer, or feed a kernel it feeds (the stages of split reductions). A pair is ranked by
the bytes a merge would save, estimated from buffer sizes alone; merge.py builds the merged
kernel and accepts or refuses it. The pass ends when no pair merges.

After a merge only the pairs near it are ranked again (`_near_merge`): ranking every pair after
every merge made scheduling quadratic in the graph's size. The setting `fusion_rank_every_pair`
ranks every pair instead, a check that both give the same merges.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember import config
from ember.ir.graph import Value
from ember.schedule import collectives
from ember.schedule.cost import size_hint
from ember.schedule.memory import nbytes
from ember.schedule.merge import FusionMemo, merged_domain, try_merge
from ember.schedule.state import Group, ScheduleState


@dataclass(frozen=True)
class FusionPolicy:
    siblings: bool = True  # merge siblings at all
    # Groups computing any of these values take no sibling merges (they raised the peak: peak.py).
    no_siblings: frozenset = frozenset()
    rank_every_pair: bool = False  # rank every pair again after each merge, not only those near it


def fuse(state: ScheduleState, policy: FusionPolicy = FusionPolicy()) -> None:
    """Best first: merge the candidate pair that saves the most bytes, until none saves any."""
    state.update_readers()  # kept current by each merge
    memo = FusionMemo()
    if config.get("overlap_collectives"):
        memo.barriers = collectives.fusion_barriers(state.graph)
    # Each group's candidate pairs, ranked, kept between merges.
    pairs: dict[int, list[tuple]] = {}
    stale = set(state.groups)
    while True:
        for bid in stale:
            b = state.groups.get(bid)
            if b is None:
                pairs.pop(bid, None)
                continue
            pairs[bid] = [
                (-_estimate_saving(state, memo, a, b), min(a.first, b.first), a.id, b.id)
                for a in _candidates(state, memo, policy, b)
            ]
        merged = _merge_best(state, memo, pairs)
        if merged is None:
            return
        aid, bid, changed = merged
        # the survivor (aid or bid) stays marked when it later absorbs another group
        if frozenset((aid, bid)) in memo.sibling_pairs or {aid, bid} & state.sibling_merged:
            state.sibling_merged |= {aid, bid}
        if policy.rank_every_pair:
            pairs.clear()
            stale = set(state.groups)
        else:
            stale = _near_merge(state, {aid, bid}, changed)


def _merge_best(state: ScheduleState, memo: FusionMemo, pairs: dict[int, list[tuple]]) -> tuple | None:
    """Try the ranked pairs in order; (a's id, b's id, the values the merge changed) for the first
    that merges, None if none does."""
    for _, _, aid, bid in sorted(p for ranked in pairs.values() for p in ranked):
        changed = try_merge(state, memo, state.groups[aid], state.groups[bid])
        if changed is not None:
            return aid, bid, changed
    return None


def _producers(state: ScheduleState, g: Group) -> set[int]:
    """Groups whose buffers g loads directly."""
    return {state.owner[v] for v in g.kernel.reads if v in state.owner}


def _candidates(state: ScheduleState, memo: FusionMemo, policy: FusionPolicy, b: Group) -> list[Group]:
    """Groups b could merge into: its producers, and siblings over a domain both fit that read a
    buffer b reads or another output of b's producer, or feed a kernel b feeds (the stages of split
    reductions: a cross-entropy's mean and its index check; merged, one launch instead of two)."""
    groups, readers = state.groups, state.readers
    out = [groups[p] for p in sorted(_producers(state, b)) if p != b.id and p in groups]
    barriers = memo.barriers  # merges that would delay a collective's start or pull compute past a wait
    if barriers is not None:
        out = [p for p in out if not barriers.keep_apart(p.roots, b.roots, siblings=False)]
    if not policy.siblings:
        return out
    producers = {g.id for g in out}
    near = {gid for v in b.kernel.reads for gid in readers.get(v, ())}
    near |= {gid for p in out for v in p.roots for gid in readers.get(v, ())}
    consumers = {gid for v in b.roots for gid in readers.get(v, ())} - {b.id}
    near |= {pid for c in consumers if c in groups for pid in _producers(state, groups[c])}
    # (A consumer of b that reads b's inputs too is not a sibling: it merges as a consumer.)
    for gid in sorted(near - producers - consumers - {b.id}):
        g = groups[gid]
        if {g.id, b.id} & set(state.gemms.by_group):
            continue  # a GEMM template takes epilogues only, never siblings
        if policy.no_siblings and not policy.no_siblings.isdisjoint(g.roots + b.roots):
            continue
        if barriers is not None and barriers.keep_apart(g.roots, b.roots, siblings=True):
            continue
        if g.id < b.id and merged_domain(state, memo, g, b) is not None:  # each unordered pair once
            out.append(g)
            memo.sibling_pairs.add(frozenset((g.id, b.id)))
    return out


def _estimate_saving(state: ScheduleState, memo: FusionMemo, a: Group, b: Group) -> int:
    """Bytes a merge saves, from buffer sizes alone (ranks candidates before building any)."""
    members = {a.id, b.id}
    saved = 0
    for prod, cons in ((a, b), (b, a)):
        for v in prod.roots:
            if v in cons.kernel.reads:  # no longer loaded; no longer stored if only cons read it
                saved += _hint_bytes(memo, v) * (1 if state.needed_outside(v, members) else 2)
    for v in set(a.kernel.reads) & set(b.kernel.reads):
        saved += _hint_bytes(memo, v)  # read once, not twice
    return saved


def _hint_bytes(memo: FusionMemo, v: Value) -> int:
    n = memo.bytes_hint.get(v)
    if n is None:
        n = memo.bytes_hint[v] = size_hint(nbytes(v))
    return n


def _near_merge(state: ScheduleState, merged: set[int], changed: set[Value]) -> set[int]:
    """The groups whose candidate pairs or their savings the last merge may have changed.

    A pair (a, b) depends on both groups, on who reads and who owns the values they read or
    compute, and on groups at most two steps from b (a producer's other readers, a consumer's
    other producers). The merge changed one group, removed another, and changed the readers or
    owner of `changed` values only: every group touching those is affected, and so is every
    group within two steps of one of them."""
    groups, readers, owner = state.groups, state.readers, state.owner
    near = {gid for gid in merged if gid in groups}
    for v in changed:
        near |= readers.get(v, set())
        if v in owner and owner[v] in groups:
            near.add(owner[v])
    frontier = set(near)
    for _ in range(2):
        reached: set[int] = set()
        for gid in frontier:
            g = groups[gid]
            for v in list(g.kernel.reads) + list(g.roots):
                reached |= readers.get(v, set())
                if v in owner:
                    reached.add(owner[v])
        frontier = {gid for gid in reached if gid in groups} - near
        near |= frontier
    return near | (merged - set(groups))
