"""Fault injection, a testing aid: the setting `fault_inject` names faults that ember raises (or
plays) at named points of its own code, so that a test proves how a failure there is handled
without replacing any of ember's functions.

`EMBER_FAULT_INJECT="patterns"`, or `config.override(fault_inject="cpu_arch=another CPU")`: a
comma-separated list of points, each optionally with an argument after `=`. The points, and what
each does where it is named, are `POINTS`. Off (empty) by default; nothing a user compiles needs
it, and it never enters a cache key: a fault changes what happens to a compile, not what code a
compile makes.

This module is a leaf: it imports only config.
"""

from __future__ import annotations

from ember import config

# point -> (whether it takes an argument, what happens where it is named)
POINTS: dict[str, tuple[bool, str]] = {
    "schedule": (False, "the scheduler is interrupted (KeyboardInterrupt), as by Ctrl-C during a pass"),
    "patterns": (False, "the attention matcher raises RuntimeError"),
    "decompose": (True, "=OP: ember's decomposition of aten.OP raises TypeError, so AOTAutograd's trace fails"),
    "cpu_arch": (True, "=TEXT: the C++ target names TEXT as its CPU, as a cache folder shared between machines sees"),
    "aot_sign": (False, "ember's part of an AOTAutograd cache entry is signed with a key that is not ember's"),
    "cache_swap": (
        True,
        (
            "=PATH: right after the disk cache has checked an entry and read its files, its file named as "
            "PATH's is overwritten with PATH's bytes (a swap between the check and the use)"
        ),
    ),
}


class InjectedFault(RuntimeError):
    """The error a `fault_inject` point raises."""


def parse(text: str) -> dict[str, str]:
    """`text` as {point: argument} ("" for none). Raises ValueError naming the valid points for an
    unknown one, or a point given without the argument it takes."""
    faults = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        point, equals, argument = item.partition("=")
        point = point.strip()
        if point not in POINTS:
            raise ValueError(f"no fault point {point!r} (valid: {', '.join(POINTS)})")
        if POINTS[point][0] != bool(equals and argument.strip()):
            needs = "takes" if POINTS[point][0] else "takes no"
            raise ValueError(f"fault point {point!r} {needs} an argument: {POINTS[point][1]}")
        faults[point] = argument.strip()
    return faults


def armed(point: str) -> str | None:
    """The argument the setting gives `point` ("" for a point without one), or None where the
    setting does not name it."""
    assert point in POINTS, point
    text = config.get("fault_inject")
    return parse(text).get(point) if text else None


def at(point: str) -> None:
    """Raise the fault of `point` (one without an argument) where the setting names it."""
    if armed(point) is None:
        return
    if point == "schedule":
        raise KeyboardInterrupt
    raise InjectedFault(f"fault injected at {point!r} (setting fault_inject)")
