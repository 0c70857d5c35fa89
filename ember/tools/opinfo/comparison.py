"""The comparison rule: compiled against eager, then against a reference in higher precision.

The rule itself is written out in the package docstring and docs/opinfo/README.md.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

# Reference precision for the second comparison, and the rule's factor and atol.
REF_DTYPE = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}
_FACTOR = {torch.float32: 2.0, torch.bfloat16: 3.0, torch.float16: 3.0}
_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# Ops whose outputs are uninitialized memory: eager's values mean nothing, compared by shape/dtype.
UNINITIALIZED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
# Ops some of whose outputs (by position) are uninitialized: the attention kernels' philox seed and
# offset are `at::empty` when there is no dropout (eager happened to read 0, ember 7161128222773766515).
UNINITIALIZED_OUTPUTS = {
    "torch.ops.aten._efficient_attention_forward": (2, 3),
    "torch.ops.aten._flash_attention_forward": (2, 3),
}


def blank_uninitialized(op_name: str, out):
    """`out` with the outputs that hold uninitialized memory replaced by their structure."""
    positions = UNINITIALIZED_OUTPUTS.get(op_name, ())
    if not positions or not isinstance(out, (tuple, list)):
        return out
    return type(out)(structure(o) if k in positions else o for k, o in enumerate(out))


def compare(actual, expected, ref_fn=None, dtype: torch.dtype | None = None, what: str = "output") -> str | None:
    """None if `actual` matches `expected` (trees of tensors and scalars), else why not.

    ref_fn() lazily gives the same tree computed in higher precision, for the second rule.
    """
    a_leaves, e_leaves = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        return f"{what}: {len(a_leaves)} values, eager {len(e_leaves)}"
    ref_leaves = None
    for k, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        name = f"{what}[{k}]" if len(a_leaves) > 1 else what
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"{name}: {type(a).__name__}, eager a tensor"
            if a.shape != e.shape:
                return f"{name}: shape {tuple(a.shape)}, eager {tuple(e.shape)}"
            if a.dtype != e.dtype:
                return f"{name}: dtype {a.dtype}, eager {e.dtype}"
            if a.device != e.device:
                return f"{name}: device {a.device}, eager {e.device}"
            try:
                torch.testing.assert_close(a, e, equal_nan=True, check_stride=False)
                continue
            except AssertionError as err:
                first = str(err).strip()
            if not e.dtype.is_floating_point or ref_fn is None:
                return f"{name}: {oneline(first)}"
            if ref_leaves is None:
                try:
                    ref_leaves = pytree.tree_leaves(ref_fn())
                except Exception as ex:  # noqa: BLE001  (the op rejects the upcast inputs)
                    return f"{name}: {oneline(first)} (no reference: {type(ex).__name__})"
            r = ref_leaves[k] if k < len(ref_leaves) else None
            why = _against_reference(a, e, r, e.dtype)
            if why is not None:
                return f"{name}: {why}; first check: {oneline(first)}"
        elif isinstance(e, float) and isinstance(a, float):
            if not (a == e or (math.isnan(a) and math.isnan(e)) or math.isclose(a, e, rel_tol=1.3e-6, abs_tol=1e-5)):
                return f"{name}: {a!r}, eager {e!r}"
        elif a != e and not (isinstance(a, torch.Tensor) or isinstance(e, torch.Tensor)):
            return f"{name}: {a!r}, eager {e!r}"
    return None


def _against_reference(a: torch.Tensor, e: torch.Tensor, r, dtype: torch.dtype) -> str | None:
    if not isinstance(r, torch.Tensor) or r.shape != a.shape or dtype not in _FACTOR:
        return "no reference to compare with"
    a64, e64, r64 = (t.detach().to("cpu", torch.float64) for t in (a, e, r))
    a_bad, e_bad, r_bad = ~torch.isfinite(a64), ~torch.isfinite(e64), ~torch.isfinite(r64)

    def same_nonfinite(x, y):
        return (torch.isnan(x) & torch.isnan(y)) | (torch.isinf(x) & (x == y))

    bad = a_bad & ~(same_nonfinite(a64, e64) | same_nonfinite(a64, r64))
    if bad.any():
        return f"{int(bad.sum())} non-finite values where eager and the reference have none"
    # Where the reference is not finite but compiled and eager agree, nothing more to compare.
    finite = ~a_bad & ~e_bad & ~r_bad
    if not finite.any():
        return None
    c_err = (a64 - r64)[finite].abs().max().item()
    e_err = (e64 - r64)[finite].abs().max().item()
    scale = max(1.0, r64[finite].abs().max().item())
    bound = _FACTOR[dtype] * e_err + _ATOL[dtype] * scale
    if c_err <= bound:
        return None
    return f"error vs {r.dtype} reference {c_err:.3g} > {_FACTOR[dtype]:g} x eager's {e_err:.3g} + {_ATOL[dtype] * scale:.3g}"


def oneline(s: str) -> str:
    return " ".join(s.split())[:300]


def structure(out) -> list:
    return [
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__ for x in pytree.tree_leaves(out)
    ]
