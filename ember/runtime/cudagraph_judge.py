"""Whether the default mode keeps a CUDA graph recording (runtime/cudagraph_pool.py records and replays;
this says when a recording pays, and over which calls it is timed).

The default mode records graphs the caller did not ask to record: a recording must pay for its replay's
copies and bookkeeping. The pool times a key's host program over HOST_TIMED_CALLS calls after its warm-up,
records it, times the recording's first replay on the device and the REPLAYS_HOST_TIMED replays after it on
the host, then asks `keep_or_drop`.
"""

from __future__ import annotations

from typing import Protocol

from ember import log
from ember.runtime.cudagraph_recording import Recording

# The default mode's recordings (keep_or_drop) are judged from steady calls: a call soon after a graph is
# compiled runs its host program 2-3x slower than later ones (caches cold, the interpreter's code not yet
# specialized), and so does a recording's first replay. The host program is timed over this many calls after its
# warm-up, a recording's replays after its first (which is timed on the device) over this many; the least counts.
HOST_TIMED_CALLS = 3
REPLAYS_HOST_TIMED = 2
# The calls a training step's default-mode graphs take to settle: the forward's warm-up and timed calls, then,
# from the call that records the forward (the backward waits for it), the backward's warm-up, timed calls,
# recording (its first replay) and timed replays (the forward's own timed replays overlap those).
SETTLING_CALLS = (1 + HOST_TIMED_CALLS) + (1 + HOST_TIMED_CALLS + 1 + REPLAYS_HOST_TIMED)


class JudgedCall(Protocol):
    """What the judgment reads of a compiled graph under the default mode's CUDA graphs (cudagraphs.Graphed)."""

    kind: str
    copy_share: float  # the share of a replay's device time its copies may take whatever the host's time
    copy_bandwidth: float  # bytes/s of a large copy on the device (0: unknown)

    def disable(self, reason: str) -> None: ...


def keep_or_drop(fn: JudgedCall, rec: Recording) -> None:
    """The default mode keeps a recording only where it pays. A call without it takes about the
    larger of the host's time running the host program and the device's running its launches; with
    it, the larger of the host's time on the replay (the pool's bookkeeping, the copies issued, the
    graph launched) and the device's on the replay plus the copies (inputs in, what the caller keeps
    out). Where the host program is the slower by more than the replay and its copies, the recording
    pays if its replay takes the host less time than the host program. Where the device is the slower
    (a GPU-bound graph), it saves at most the gaps between launches, and the copies cost device time:
    it is kept only while they take at most `copy_share` of the replay's time, whatever the host's
    times (which, with the device behind, read its pace: both near the replay's device time). A
    training step's host time lies mostly outside its graphs (autograd, the optimizer), so a graph
    alone measures GPU-bound there even where the step is not: that is what the share allows for."""
    rec.judged = True
    # The copies' time from their bytes (read and written; inputs copied in and what the caller keeps
    # copied out) at the device's measured copy bandwidth: timed with events, a few small copies would
    # read as the host's time issuing them, the device idle meanwhile.
    copied = rec.copied_bytes() + rec.copy_in_bytes
    copies_s = 2 * copied / fn.copy_bandwidth if fn.copy_bandwidth else 0.0
    replay_s, host_s, replay_host_s = rec.device_seconds or 0.0, rec.host_seconds, rec.replay_host_seconds
    host_bound = host_s > replay_s + copies_s
    cheap_copies = copies_s <= fn.copy_share * replay_s
    pays = (host_bound and replay_host_s < host_s) or cheap_copies
    said = (
        f"replay {replay_s * 1e3:.3f} ms and copies in and of what the caller keeps {copies_s * 1e3:.3f} ms on "
        f"the device; on the host, the host program {host_s * 1e3:.3f} ms, the replay {replay_host_s * 1e3:.3f} ms"
    )
    if pays:
        log.artifact("cudagraphs", f"{fn.kind} graph", f"recording {rec.index} kept: {said}")
        return
    why = (
        "the host is the slower, and the replay takes it no less time than the host program"
        if host_bound
        else f"the copies take more than {fn.copy_share:.0%} of the replay and the host is not the slower"
    )
    # The graph runs its host program from here on, building no key per call; its recordings are released
    # once no tensor they handed out is held (the saved tensors of this very call, until its backward).
    fn.disable(f"recording {rec.index} dropped: {said} ({why})")
