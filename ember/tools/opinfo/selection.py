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


def select_ops(patterns: list[str] | None, skip: list[str] | None = None) -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    def hit(op, pats):
        names = (op_name(op), op.name)
        return any(fnmatch.fnmatchcase(n, p) for p in pats for n in names)

    ops = [op for op in op_db if not patterns or hit(op, patterns)]
    return [op for op in ops if not skip or not hit(op, skip)]


def pairs(ops, dtypes: list[torch.dtype], device: str) -> list[tuple[Any, torch.dtype]]:
    out = []
    for op in ops:
        supported = op.supported_dtypes(device)
        out += [(op, d) for d in dtypes if d in supported]
    return out


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")
