"""Online softmax: the max of a row and the sum of exp(x - max) in one pass over it.

Softmax, log_softmax, logsumexp and cross-entropy reduce each row twice: first its max m, then
sum(exp(x - m)). When a row is too long to stay in registers (a looped reduction), that is two
trips through device memory for the same row. Keeping per lane a running max m and a sum s
rescaled whenever m grows,

    m' = max(m, x);   s' = s * exp(m - m') + exp(x - m')

gives both in one trip; at the end of the row the lanes combine as
M = max(m), S = sum(s * exp(m - M)). (Milakov and Gimelshein, "Online normalizer calculation
for softmax", 2018.) It costs one more exp per element, which a memory-bound GPU kernel does
not notice; rows held whole in registers already read memory once, so they keep the plain form.

The pass rewrites the kernel IR: a `sum` reduction whose argument is exactly
`exp(a - max_reduce(a))` becomes a `sumexp` reduction of `a` partnered with that max, in the
max's phase; then every phase number and readiness is recomputed, so later loops (the
normalizing store of softmax) move one phase earlier.
"""

from __future__ import annotations

from ember.schedule.cost import is_persistent
from ember.schedule.kernel import Kernel, KOp, KReduce, walk


def fold_online_softmax(kernel: Kernel) -> int:
    """Rewrite max-then-sum-of-exp pairs of a looped reduction kernel; returns how many."""
    if is_persistent(kernel):
        return 0
    folded = 0
    for r in kernel.reduces:
        partner = _exp_of_shift_by_max(r)
        if partner is None:
            continue
        r.kind, r.arg, r.online_max = "sumexp", partner.arg, partner
        folded += 1
    if folded:
        _recompute_phases(kernel)
    return folded


def _exp_of_shift_by_max(r: KReduce) -> KReduce | None:
    """The max reduction m if r is sum(exp(a - m)) with m = max(a) over the same rows."""
    if r.kind != "sum" or not isinstance(r.arg, KOp) or r.arg.fn != "exp":
        return None
    (shifted,) = r.arg.operands
    if not isinstance(shifted, KOp) or shifted.fn != "sub":
        return None
    a, m = shifted.operands
    if not isinstance(m, KReduce) or m.kind != "max" or m.arg is not a or m.online_max is not None:
        return None
    if not a.dtype.is_floating_point or r.dtype != a.dtype:
        return None
    return m


def _recompute_phases(kernel: Kernel) -> None:
    """Readiness and phases from scratch, producers first (walk's order)."""
    for n in walk(kernel):
        if isinstance(n, KReduce):
            n.phase = n.arg.ready
            n.ready = n.phase + 1
        else:
            n.ready = max((a.ready for a in n.args()), default=0)
    for s in kernel.stores:
        s.phase = max(s.value.ready, s.row.position.ready if s.row is not None else 0)
    kernel.num_phases = max(
        [r.phase + 1 for r in kernel.reduces] + [s.phase + 1 for s in kernel.stores if s.full] + [1]
    )
