"""`ember.explain(fn, *args)`: compile and run fn once, forward and backward, and report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ember.report import ExplainReport, collecting


def _grad_leaves(fn: Callable, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    leaves = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    if isinstance(fn, torch.nn.Module):
        leaves += [p for p in fn.parameters() if p.requires_grad]
    return leaves


def explain(fn: Callable, *args: Any, **kwargs: Any) -> ExplainReport:
    import torch._dynamo

    from ember.frontend.backend import ember_backend

    torch._dynamo.reset()  # a fresh capture, so every graph is compiled (and reported) again
    compiled = torch.compile(fn, backend=ember_backend)
    with collecting() as report:
        out = compiled(*args, **kwargs)
        outputs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        outputs = [o for o in outputs if o.requires_grad]
        leaves = _grad_leaves(fn, args, kwargs)
        if outputs and leaves:
            # torch.autograd.grad leaves .grad untouched: explaining must not change the model.
            torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs], allow_unused=True)
    return report
