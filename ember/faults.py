"""Fault injection, a testing aid: the setting `fault_inject` names faults that ember raises (or
plays) at named points of its own code, so that a test proves how a failure there is handled
without replacing any of ember's functions.

`EMBER_FAULT_INJECT="patterns"`, or `config.override(fault_inject="cpu_arch=another CPU")`: a
comma-separated list of points, each optionally with an argument after `=`. The points, and what
each does where it is named, are fault_points.FAULT_POINTS (the registry validates the setting). Off
(empty) by default; nothing a user compiles needs it, and it never enters a cache key: a fault
changes what happens to a compile, not what code a compile makes.

This module is a leaf: it imports only config and fault_points.
"""

from __future__ import annotations

from ember import config
from ember.fault_points import FAULT_POINTS, parse_faults


class InjectedFault(RuntimeError):
    """The error a `fault_inject` point raises."""


def armed(point: str) -> str | None:
    """The argument the setting gives `point` ("" for a point without one), or None where the
    setting does not name it."""
    assert point in FAULT_POINTS, point
    text = config.get("fault_inject")
    return parse_faults(text).get(point) if text else None


def at(point: str) -> None:
    """Raise the fault of `point` (one without an argument) where the setting names it."""
    if armed(point) is None:
        return
    if point == "schedule":
        raise KeyboardInterrupt
    raise InjectedFault(f"fault injected at {point!r} (setting fault_inject)")
