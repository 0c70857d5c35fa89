"""One OpInfo sample: its outcome, copies of its inputs, and its eager and higher-precision results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ember.tools.opinfo.comparison import REF_DTYPE, compare
from ember.tools.opinfo.selection import settle

OUTCOMES = ("match", "fallback", "skipped", "mismatch", "crash", "timeout")
# Worse outcomes win when a sample's forward and backward disagree.
_RANK = {"match": 0, "fallback": 1, "timeout": 2, "mismatch": 3, "crash": 4}


class SweepTimeout(BaseException):
    """Raised by the per-pair alarm; a BaseException so that ember's own fail-safe does not catch it."""


@dataclass
class Sample:
    index: int
    case: tuple  # (input, args, kwargs), tensors are the original sample's
    process_grad: Any = None
    eager: Any = None
    eager_grads: list | None = None  # None: no gradient check for this sample
    grad_inputs: list = field(default_factory=list)  # positions (in flattened case) of grad leaves
    random: bool = False
    outcome: str | None = None
    reason: str = ""

    def finish(self, outcome: str, reason: str = "") -> None:
        if self.outcome is None or _RANK.get(outcome, 0) > _RANK.get(self.outcome, 0):
            self.outcome, self.reason = outcome, reason[:400]


# -- copying inputs ----------------------------------------------------------------------------


def _copy_tensor(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh leaf with x's values and, unless the dtype changes, x's exact layout (strides, offset)."""
    if dtype is not None and dtype != x.dtype:
        y = x.detach().to(dtype)
    elif x.layout != torch.strided or x.numel() == 0:
        y = x.detach().clone()
    else:
        storage = x.untyped_storage().nbytes() // x.element_size()
        flat = torch.empty(storage, dtype=x.dtype, device=x.device)
        flat.copy_(x.detach().as_strided((storage,), (1,), 0))
        y = flat.as_strided(x.shape, x.stride(), x.storage_offset())
    return y.detach().requires_grad_(x.requires_grad and (y.dtype.is_floating_point or y.dtype.is_complex))


def copy_case(case, upcast_from: torch.dtype | None = None, upcast_to: torch.dtype | None = None):
    def one(x):
        if isinstance(x, torch.dtype) and upcast_from is not None and x == upcast_from:
            return upcast_to  # _softmax_backward_data(..., input_dtype): the dtype travels with the tensors
        if not isinstance(x, torch.Tensor):
            return x
        return _copy_tensor(x, upcast_to if upcast_from is not None and x.dtype == upcast_from else None)

    return pytree.tree_map(one, case)


def grad_leaves(case) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(case) if isinstance(x, torch.Tensor) and x.requires_grad]


def cotangents(outs: list, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    cots = []
    for o in outs:
        c = torch.randn(o.shape, generator=g, dtype=torch.float64).to(dtype=o.dtype, device=o.device)
        cots.append(c)
    return cots


def diff_outputs(out) -> list[torch.Tensor]:
    return [
        o
        for o in pytree.tree_leaves(out)
        if isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point
    ]


# -- eager and reference results ---------------------------------------------------------------


def _call(op, case):
    inp, args, kwargs = case
    return settle(op, op(inp, *args, **kwargs))


def run_eager(op, s: Sample, want_grad: bool, seed: int) -> None:
    """Eager result (and gradients), and whether the op is random (another seed, another result)."""
    case = copy_case(s.case)
    torch.manual_seed(seed)
    out = _call(op, case)
    if s.process_grad is not None and want_grad:
        out_g = s.process_grad(out)
    else:
        out_g = out
    s.eager = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
    if want_grad:
        outs, leaves = diff_outputs(out_g), grad_leaves(case)
        if outs and leaves:
            try:
                grads = torch.autograd.grad(outs, leaves, cotangents(outs, seed), allow_unused=True)
                s.eager_grads = [g.detach() if g is not None else None for g in grads]
            except Exception:  # noqa: BLE001
                s.eager_grads = None  # eager cannot differentiate this sample: forward only
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        again = _call(op, copy_case(s.case))
    if compare(again, s.eager) is not None:
        s.random = True


def reference(op, s: Sample, dtype: torch.dtype, grads: bool, seed: int):
    """Outputs (or gradients) of the sample in higher precision."""
    ref_dtype = REF_DTYPE[dtype]
    case = copy_case(s.case, upcast_from=dtype, upcast_to=ref_dtype)
    torch.manual_seed(seed)
    out = _call(op, case)
    if not grads:
        return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
    out_g = s.process_grad(out) if s.process_grad is not None else out
    outs, leaves = diff_outputs(out_g), grad_leaves(case)
    cots = [c.to(o.dtype) for c, o in zip(cotangents([o.to(dtype) for o in outs], seed), outs)]
    return list(torch.autograd.grad(outs, leaves, cots, allow_unused=True))
