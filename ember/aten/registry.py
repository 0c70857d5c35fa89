"""The lowering registry: ATen op -> the function that lowers it into ember's IR.

A lowering is `fn(builder, node)`: it reads the FX node's arguments and adds ember nodes through
the graph builder (builder.py), and returns the node's value (a tuple for ops with several
results). It declines one particular call by raising `Unsupported`; that call then runs as an
ATen extern, as every op without a lowering does. `GraphUnsupported` says that the whole graph
cannot be compiled (the backend runs it eagerly).

The modules under lowerings/ fill the registry, each op family registering its own functions
with `@lowering(...)`; the importer imports them. Nothing here imports them back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# fn(builder, node): the builder is builder.GraphBuilder, which this module does not import (the
# builder raises this module's exceptions).
Lowering = Callable[[Any, torch.fx.Node], Any]

_LOWERINGS: dict[Any, Lowering] = {}


class Unsupported(Exception):
    """A lowering declines this node; the importer makes it an extern instead."""


class GraphUnsupported(Exception):
    """The whole graph cannot be compiled (the backend falls back to eager)."""


def lowering(*targets) -> Callable[[Lowering], Lowering]:
    """Register a lowering for ATen op packets or overloads (one function per op family). An op
    registered twice is an error: which of two lowerings ran would depend on import order."""

    def register(fn: Lowering) -> Lowering:
        for target in targets:  # every target checked before any is registered
            existing = _LOWERINGS.get(target)
            if existing is not None and existing is not fn:
                raise ValueError(
                    f"{target} has a lowering already ({existing.__module__}.{existing.__qualname__}); "
                    f"{fn.__module__}.{fn.__qualname__} would replace it"
                )
        _LOWERINGS.update(dict.fromkeys(targets, fn))
        return fn

    return register


def lowering_for(target) -> Lowering | None:
    """The lowering of an FX call's target: registered for the overload itself, or for its packet."""
    return _LOWERINGS.get(target) or _LOWERINGS.get(getattr(target, "overloadpacket", None))
