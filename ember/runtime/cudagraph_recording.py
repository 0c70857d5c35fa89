"""A CUDA graph's recording: its graph, its buffers, and what each replay gives the caller.

`Recording` is the bookkeeping of one capture that runtime/cudagraph_pool.py's `Pool` made: the
inputs it reads, what it copies in and back, the storages its outputs view, and which outputs a
replay hands out over the pool's memory (tracked by weak references, so that no replay writes over
one still held), copies into fresh tensors, or rebuilds on the caller's own input storage.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# A storage's reference count: its tensors and the Python storage objects over it (PyTorch's CUDA graph trees
# read it to find their outputs' storages dead).
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _listed_refs() -> int:
    """What sys.getrefcount reads for an object held by one list alone, read as orphaned_input reads it (the
    interpreter may borrow the argument's reference)."""
    held = [object()]
    return sys.getrefcount(held[0])


_LISTED_REFS = _listed_refs()

_PRUNE_GIVEN_FROM = 64  # handed-out storages a recording notes before it first drops the dead ones


@dataclass
class Recording:
    index: int  # order of recording in the pool
    kind: str  # the compiled graph's: inference, forward, backward
    graph: Any
    inputs: list  # what the graph reads: static inputs themselves, buffers for the others
    copy_in: list[tuple[int, Any]]  # (input position, index selecting what to copy)
    copy_out: list[int]  # mutated inputs that were copied in: copied back after a replay
    outputs: list  # as recorded: their memory stays allocated while the recording lives
    storages: list[tuple[int, int]]  # (data pointer, bytes) of each pool storage an output views
    handed: list[tuple[int, int, dict]]  # (output position, storage number, tensor metadata)
    # Outputs over a static input's or an in-pool input's memory: (output position, input position, metadata).
    # Each replay rebuilds them on the storage of the caller's tensor itself, so that whatever tracks that
    # storage (the recording that handed it out) sees them held.
    aliased: list[tuple[int, int, dict]] = field(default_factory=list)
    # What a call must match to replay it, checked before building a key: the static tensors' positions,
    # each input's address (0 where not static) and the other tensors' strides.
    static_tensors: list[int] = field(default_factory=list)
    addresses: list[int] = field(default_factory=list)
    strides: list[tuple[int, tuple]] = field(default_factory=list)
    live: list[StorageWeakRef] = field(default_factory=list)  # this step's outputs
    # Every storage ever handed out that is still alive, of this step or an earlier one: the recording's
    # memory is released only when none is left (a stale output may not yet be invalidated).
    given: list[StorageWeakRef] = field(default_factory=list)
    prune_given_at: int = _PRUNE_GIVEN_FROM  # `given`'s length at which give() drops the dead ones
    released: bool = False
    # Every address table the graph reads (CaptureScope.tables), held: a graph holds no tensor it reads,
    # and the memory of a table let go would be handed out again and its rows written over. Those with
    # `positions` follow the inputs read through tables only, taken where they are: `bound`, their
    # addresses the tables were last written for (0 elsewhere).
    tables: list = field(default_factory=list)
    rebound: list[int] = field(default_factory=list)
    bound: list[int] = field(default_factory=list)
    in_pool: list[int] = field(default_factory=list)  # inputs an earlier recording handed out, read where they are
    owned_static: list[int] = field(default_factory=list)  # static inputs held as the caller's tensors themselves
    replays: int = 0
    copy_in_bytes: int = 0  # what a replay copies in (copy_in's inputs, whole)
    checked: int = -1  # the pool's `changes` when a call's key last named this recording
    # The default mode's (cudagraph_judge.keep_or_drop): the host program's time on calls of its key; since its copies
    # last changed, its first replay's time on the device, the least host time of the replays after it and how
    # many of them were timed; and whether it was judged (kept: dropped ones are released).
    host_seconds: float = 0.0
    device_seconds: float | None = None
    replay_host_seconds: float = float("inf")
    replays_host_timed: int = 0
    judged: bool = False
    handed_from: int | None = 0  # as GraphedCall says; a default-mode backward's turns None (_copy_held)
    # The inputs of copy_in copied whole, by one foreach copy: an optimizer step reads a step counter per
    # parameter, each a copy launched from Python (148 for GPT-2) when taken one by one.
    copy_whole: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.copy_whole = [k for k, index in self.copy_in if index is None]

    def judge_again(self) -> None:
        """Time this recording's replays again and judge it anew (its copies changed)."""
        self.judged, self.device_seconds = False, None
        self.replay_host_seconds, self.replays_host_timed = float("inf"), 0

    def held(self) -> bool:
        return any(not ref.expired() for ref in self.live)

    def any_given_alive(self) -> bool:
        self.given = [ref for ref in self.given if not ref.expired()]
        return bool(self.given)

    def orphaned_input(self) -> int | None:
        """A static input whose memory no tensor but this recording's own holds, or None. No call can come
        with that address again while the recording holds it, so the recording can never replay: a static
        KV cache that each `generate()` call makes anew, the last call's cache held only here."""
        if _use_count is None or self.released:
            return None
        ours = None
        for k in self.owned_static:
            if sys.getrefcount(self.inputs[k]) > _LISTED_REFS:
                continue  # the caller holds the tensor itself
            ours = ours or _storages_held(self.inputs, self.outputs)
            storage = self.inputs[k].untyped_storage()
            if _use_count(storage._cdata) == ours[storage._cdata] + 1:  # + 1: `storage` itself
                return k  # no other tensor views its memory either
        return None

    def release(self) -> None:
        """Drop the graph, its copy buffers and its outputs' memory (back to the pool): it never replays again."""
        self.graph, self.inputs, self.outputs, self.copy_in, self.copy_whole = None, [], [], [], []
        self.tables = []
        self.live, self.given, self.released = [], [], True

    def _copied_below(self) -> int:
        """The outputs before this position are copied (give())."""
        return len(self.outputs) if self.handed_from is None else self.handed_from

    def copied_bytes(self) -> int:
        """The bytes a replay's copies read (give(): the storages of the outputs before `handed_from`)."""
        cut = self._copied_below()
        return sum(self.storages[number][1] for number in {number for pos, number, _ in self.handed if pos < cut})

    def give(self, device: torch.device, sources: list) -> list:
        """The outputs of a replay. Those at positions from `handed_from` on (every one where it is 0,
        none where it is None) are handed out, on storages made for this replay: a later step
        invalidates these without touching the recording's own. The others are fresh copies of the
        storages they view, all made by one foreach copy; a storage is copied whole, so expanded
        (stride 0) outputs and outputs viewing one another keep their layout and aliasing. An output over
        a static or in-pool input's memory is made on `sources`, the storages of this call's inputs."""
        cut = self._copied_below()
        out = list(self.outputs)
        for (pos, _, meta), storage in zip(self.aliased, sources, strict=True):
            out[pos] = _on_caller_storage(storage, meta)
        handed = [entry for entry in self.handed if entry[0] >= cut]
        if handed:
            storages = {}
            for _, number, _ in handed:
                if number not in storages:
                    ptr, nbytes = self.storages[number]
                    storages[number] = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
            self.live = [StorageWeakRef(s) for s in storages.values()]
            self.given += self.live
            if len(self.given) >= self.prune_given_at:  # else a long loop's outputs pile up, one entry each
                self.any_given_alive()
                self.prune_given_at = 2 * len(self.given) + _PRUNE_GIVEN_FROM  # amortized: not every replay
            for pos, number, meta in handed:
                out[pos] = _on_storage(storages[number], meta)
        copied = [entry for entry in self.handed if entry[0] < cut]
        if copied:
            recorded: dict[int, Any] = {}  # storage number -> the recording's storage, copied from
            for pos, number, _ in copied:
                recorded.setdefault(number, self.outputs[pos].untyped_storage())
            fresh = {
                number: torch.empty(s.nbytes(), dtype=torch.uint8, device=device) for number, s in recorded.items()
            }
            torch._foreach_copy_(list(fresh.values()), [_bytes(recorded[number]) for number in fresh])
            for pos, number, meta in copied:
                out[pos] = _on_storage(fresh[number].untyped_storage(), meta)
        return out


def _storages_held(*tensor_lists: list) -> dict[int, int]:
    """StorageImpl -> how many of the tensors in `tensor_lists` view it."""
    counts: dict[int, int] = {}
    for tensors in tensor_lists:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                impl = t.untyped_storage()._cdata
                counts[impl] = counts.get(impl, 0) + 1
    return counts


def _on_caller_storage(storage, meta: dict) -> torch.Tensor:
    """The output `meta` describes, remade over the caller's storage of the input it views. The call's
    key holds that input's address, not its storage's start: the offset is taken from the addresses."""
    itemsize = meta["dtype"].itemsize
    offset = (meta["data_ptr"] + meta["storage_offset"] * itemsize - storage.data_ptr()) // itemsize
    return _on_storage(storage, {**meta, "storage_offset": offset})


def _bytes(storage) -> torch.Tensor:
    """The storage's bytes as a uint8 tensor (what a foreach copy takes)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _on_storage(storage, meta: dict) -> torch.Tensor:
    make = getattr(torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata", None)
    if make is not None and meta["device"].type == "cuda":
        return make(meta, storage)
    t = torch.empty((0,), dtype=meta["dtype"], device=meta["device"])
    return t.set_(storage, meta["storage_offset"], meta["size"], meta["stride"])


def tensor_meta(t: torch.Tensor) -> dict:
    """What `_on_storage` makes `t` again from."""
    storage = t.untyped_storage()
    return {
        "nbytes": storage.nbytes(),
        "data_ptr": storage.data_ptr(),
        "size": t.shape,
        "stride": t.stride(),
        "dtype": t.dtype,
        "device": t.device,
        "storage_offset": t.storage_offset(),
    }


def unowned_view(t: torch.Tensor) -> torch.Tensor:
    """`t`, on a storage that points at its memory without owning it."""
    meta = tensor_meta(t)
    unowned = torch._C._construct_storage_from_data_pointer(meta["data_ptr"], t.device, meta["nbytes"])
    return _on_storage(unowned, meta)
