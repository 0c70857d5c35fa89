"""What sets a call's key apart from the recorded ones (runtime/cudagraph_pool.py decides with it).

A key (cudagraphs.Graphed.key) holds, per input, a static input's address, another tensor's strides (with its
address where it lies in the pool's memory), or a non-tensor's value, then, where sizes vary, every input's
shape. These compare keys: for the log's account of a call past the bound, and for the rules on static inputs
that move (a backward's saved tensors, a KV cache made anew).
"""

from __future__ import annotations

from collections.abc import Iterable

# Address sets a default-mode backward's moving saved tensors are recorded for (two alternate where the
# allocator hands a step's memory back in turn); at another, it runs its host program from then on.
MOVED_KEYS = 2

# A recording released after fewer replays than this (its static inputs dropped) is short-lived: at
# `cudagraphs_max_graphs` of them in a row, the graph runs its host program, since a capture costs many calls' time.
SHORT_LIVED = 8


def moved_only(static: frozenset[int], old: tuple, key: tuple, n_args: int) -> bool:
    """Whether `key` differs from `old` in static inputs' addresses alone."""
    if len(old) != len(key):
        return False
    return all(a == b or (k < n_args and k in static) for k, (a, b) in enumerate(zip(old, key)))


def moved_static(
    seen: Iterable[tuple], static: frozenset[int], key: tuple, args: list, resident: frozenset[int]
) -> bool:
    """Whether only static inputs' addresses set this key apart from one seen, none in the pool's memory."""
    for old in seen:
        if old != key and moved_only(static, old, key, len(args)):
            moved = [k for k, (a, b) in enumerate(zip(old, key)) if a != b]
            return not any(args[k].untyped_storage().data_ptr() in resident for k in moved)
    return False


def what_changed(seen: Iterable[tuple], static: frozenset[int], key: tuple, n_args: int) -> str:
    """Which inputs set this call's key apart from the nearest one seen: what a user needs to find
    the tensor that moves (a parameter replaced every step, an output kept from a plain run)."""
    nearest = min(
        (old for old in seen if len(old) == len(key)),
        key=lambda old: sum(a != b for a, b in zip(old, key, strict=True)),
        default=None,
    )
    if nearest is None:
        return "a new number of inputs"
    parts = []
    for k, (a, b) in enumerate(zip(nearest, key, strict=True)):
        if a == b:
            continue
        if k >= n_args:
            parts.append(f"input {k - n_args}'s shape")
        elif k in static:
            parts.append(f"static input {k}'s address")
        else:
            parts.append(f"input {k}'s strides, value or address in the pool")
    shown = ", ".join(parts[:6]) + (f" and {len(parts) - 6} more" if len(parts) > 6 else "")
    return f"this call differs from the nearest recorded one in {shown}"
