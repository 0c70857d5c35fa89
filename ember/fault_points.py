"""The fault points of the testing aid `fault_inject` (ember/faults.py raises or plays them) and the
setting's parser, which the settings registry validates the setting with. A leaf: it imports nothing
of ember's, so that config and faults can both read it."""

from __future__ import annotations

# point -> (whether it takes an argument, what happens where it is named)
FAULT_POINTS: dict[str, tuple[bool, str]] = {
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


def parse_faults(text: str) -> dict[str, str]:
    """`text` as {point: argument} ("" for none). Raises ValueError naming the valid points for an
    unknown one, or a point given without the argument it takes."""
    faults = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        point, equals, argument = item.partition("=")
        point = point.strip()
        if point not in FAULT_POINTS:
            raise ValueError(f"no fault point {point!r} (valid: {', '.join(FAULT_POINTS)})")
        if FAULT_POINTS[point][0] != bool(equals and argument.strip()):
            needs = "takes" if FAULT_POINTS[point][0] else "takes no"
            raise ValueError(f"fault point {point!r} {needs} an argument: {FAULT_POINTS[point][1]}")
        faults[point] = argument.strip()
    return faults
