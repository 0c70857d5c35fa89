"""Which (op, dtype) pairs run: OpInfo ops by name or glob, and the dtypes each op supports."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
}


def op_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


class InplaceVariant:
    """An OpInfo's in-place variant (`x.add_(y)`, `F.relu(x, inplace=True)`) as the sweep runs it: the
    sample's input is written in place, and a call returns (result, the input after the call), so the
    comparison covers both; `settle` adds whether the result is the input object itself, as eager's is.
    Named `<op>_` (`add_`, `div_.floor_rounding`); forward only (a leaf that requires grad cannot be
    written in place). Everything else is the OpInfo's."""

    supports_autograd = False

    def __init__(self, op):
        self.op = op
        self.name = op.name + "_"

    def __getattr__(self, attr: str):
        return getattr(self.op, attr)

    def __call__(self, inp, *args, **kwargs):
        return self.op.inplace_variant(inp, *args, **kwargs), inp

    def sample_inputs(self, device, dtype, requires_grad: bool = False):
        return self.op.sample_inputs(device, dtype, requires_grad=False)

    @staticmethod
    def settle(out):
        result, inp = out
        return result, inp, result is inp


def settle(op, out):
    """A call's outputs as compared: an in-place variant's gain whether the result is the input."""
    return op.settle(out) if isinstance(op, InplaceVariant) else out


def select_ops(patterns: list[str] | None, skip: list[str] | None = None, inplace: bool = False) -> list:
    """OpInfo ops by name or glob; `inplace`: the in-place variants of those that have one."""
    from torch.testing._internal.common_methods_invocations import op_db

    def hit(op, pats):
        names = (op_name(op), op.name) + ((op_name(op.op), op.op.name) if isinstance(op, InplaceVariant) else ())
        return any(fnmatch.fnmatchcase(n, p) for p in pats for n in names)

    ops = [InplaceVariant(op) for op in op_db if op.inplace_variant is not None] if inplace else op_db
    ops = [op for op in ops if not patterns or hit(op, patterns)]
    return [op for op in ops if not skip or not hit(op, skip)]


def pairs(ops, dtypes: list[torch.dtype], device: str) -> list[tuple[Any, torch.dtype]]:
    out = []
    for op in ops:
        supported = op.supported_dtypes(device)
        out += [(op, d) for d in dtypes if d in supported]
    return out


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")
